// Renders an Ollama TEMPLATE with Go's text/template (the engine Ollama uses), for tests.
// Input on stdin: {"template": "...", "messages": [{"role": "user", "content": "..."}]}.
package main

import (
	"encoding/json"
	"os"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type Input struct {
	Template string    `json:"template"`
	Messages []Message `json:"messages"`
}

func main() {
	var input Input
	if err := json.NewDecoder(os.Stdin).Decode(&input); err != nil {
		panic(err)
	}
	tmpl := template.Must(template.New("ollama").Parse(input.Template))
	if err := tmpl.Execute(os.Stdout, map[string]any{"Messages": input.Messages}); err != nil {
		panic(err)
	}
}
