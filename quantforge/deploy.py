"""Memory fit on a GPU, and the files that put an artifact to use: serve commands, an Ollama Modelfile.

Memory model (stated on the card): a serving engine may use ``GPU_UTILIZATION`` of the GPU's memory (vLLM's
default ``--gpu-memory-utilization``), of which ``RUNTIME_OVERHEAD_GB`` goes to activations, the CUDA context and
graphs; the rest holds the weights (the artifact's tensor bytes) and the KV cache, which costs
layers x KV heads x head dim x 2 (K and V) x 2 bytes (fp16) per token of every sequence.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .errors import QuantforgeError
from .gpus import GPUS

GPU_UTILIZATION = 0.90
RUNTIME_OVERHEAD_GB = 1.0
KV_DTYPE_BYTES = 2


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bandwidth_gbs: float | None  # None for a custom "20GB" entry


def parse_gpu(text: str) -> GPU:
    """A GPU from the built-in table (case and spaces ignored) or a custom size such as ``20GB``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|G|GIB)?\s*", text, re.IGNORECASE)
    if match:
        memory = float(match.group(1))
        if memory <= 0:
            raise QuantforgeError(f"--gpu {text}: the memory size must be positive")
        return GPU(f"{memory:g} GB GPU", memory, None)
    wanted = re.sub(r"[\s_-]", "", text).lower()
    for name, (memory, bandwidth) in GPUS.items():
        if re.sub(r"[\s_-]", "", name).lower() == wanted:
            return GPU(name, memory, bandwidth)
    raise QuantforgeError(f"unknown GPU '{text}'; known: {', '.join(GPUS)}, or a size such as 20GB")


def kv_bytes_per_token(config: dict) -> int:
    return config["num_layers"] * config["num_kv_heads"] * config["head_dim"] * 2 * KV_DTYPE_BYTES


def memory_fit(weight_bytes: int, config: dict, gpu: GPU, context: int, concurrency: int) -> dict:
    usable = gpu.memory_gb * 1e9 * GPU_UTILIZATION - RUNTIME_OVERHEAD_GB * 1e9
    per_token = kv_bytes_per_token(config)
    needed = weight_bytes + per_token * context * concurrency
    left_for_kv = usable - weight_bytes
    largest_context = int(left_for_kv // (per_token * concurrency)) if left_for_kv > 0 else 0
    max_positions = config.get("max_position_embeddings")
    return {
        "gpu": gpu.name,
        "gpu_memory_gb": gpu.memory_gb,
        "context": context,
        "concurrency": concurrency,
        "weights_gb": weight_bytes / 1e9,
        "kv_cache_gb": per_token * context * concurrency / 1e9,
        "needed_gb": needed / 1e9,
        "usable_gb": usable / 1e9,
        "fits": needed <= usable,
        "largest_context": min(largest_context, max_positions) if max_positions else largest_context,
        "kv_bytes_per_token": per_token,
    }


# ----------------------------------------------------------------------------------------------- commands

VLLM_QUANTIZATION = {"gptq": "gptq", "awq": "awq", "compressed-tensors": "compressed-tensors"}


def vllm_command(folder_name: str, quant_method: str, max_model_len: int) -> str:
    quantization = VLLM_QUANTIZATION.get(quant_method, quant_method)
    return (
        f"vllm serve ./{folder_name} --quantization {quantization} --max-model-len {max_model_len} "
        f"--gpu-memory-utilization {GPU_UTILIZATION}"
    )


def llama_cpp_command(gguf_name: str, context: int) -> str:
    return f"llama-server -m {shlex.quote(gguf_name)} -c {context} --jinja"


# ----------------------------------------------------------------------------------------------- Ollama

MARK = "\x00{}\x00"


def _render(template: str, messages: list[dict], add_generation_prompt: bool, special: dict) -> str:
    import jinja2

    environment = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    return environment.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special
    )


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start) + len(start) : text.index(end)]


def chat_template_to_ollama(template: str, special: dict) -> tuple[str, list[str]]:
    """An Ollama (Go text/template) TEMPLATE equivalent to a Hugging Face chat template, and its stop strings.

    The Jinja template is rendered with marked messages to learn, for each role, the text around a message, any
    default system block it inserts, and the generation prompt. Templates whose per-role wrapping is not that
    regular (tool calls, content-dependent branches) are refused rather than approximated.
    """
    s, u, a = MARK.format("S"), MARK.format("U"), MARK.format("A")
    u2 = MARK.format("U2")
    full = _render(
        template,
        [
            {"role": "system", "content": s},
            {"role": "user", "content": u},
            {"role": "assistant", "content": a},
            {"role": "user", "content": u2},
        ],
        True,
        special,
    )
    try:
        system_prefix = full[: full.index(s)]
        system_suffix, user_prefix = _split_gap(_between(full, s, u), full, s, u, template, special)
        user_suffix, assistant_prefix = _split_gap(_between(full, u, a), full, u, a, template, special)
        assistant_suffix = _between(full, a, u2)[: -len(user_prefix)] if user_prefix else _between(full, a, u2)
        generation = full[full.index(u2) + len(u2) + len(user_suffix) :]
    except ValueError:
        raise QuantforgeError(
            "this chat template does not wrap messages in a fixed way per role; write the Ollama TEMPLATE by hand"
        ) from None
    no_system = _render(template, [{"role": "user", "content": u}], True, special)
    default_system = (
        no_system[: no_system.index(u)][: -len(user_prefix)] if user_prefix else no_system[: no_system.index(u)]
    )

    def literal(text: str) -> str:
        if "{{" in text or "}}" in text:
            raise QuantforgeError("the chat template's fixed text contains '{{': write the Ollama TEMPLATE by hand")
        return text

    parts = []
    if default_system:
        parts.append(
            '{{ if or (not .Messages) (ne (index .Messages 0).Role "system") }}'
            f"{literal(default_system)}{{{{ end }}}}"
        )
    parts.append("{{ range .Messages }}")
    parts.append(f'{{{{ if eq .Role "system" }}}}{literal(system_prefix)}{{{{ .Content }}}}{literal(system_suffix)}')
    parts.append(f'{{{{ else if eq .Role "user" }}}}{literal(user_prefix)}{{{{ .Content }}}}{literal(user_suffix)}')
    parts.append(
        f'{{{{ else if eq .Role "assistant" }}}}{literal(assistant_prefix)}{{{{ .Content }}}}'
        f"{literal(assistant_suffix)}"
    )
    parts.append("{{ end }}{{ end }}" + literal(generation))
    stops = sorted(
        {piece.strip() for piece in (user_suffix, assistant_suffix, special.get("eos_token") or "") if piece.strip()}
    )
    return "".join(parts), stops


def _split_gap(gap: str, full: str, left: str, right: str, template: str, special: dict) -> tuple[str, str]:
    """Split the text between two messages into the first one's suffix and the second one's prefix.

    The suffix of a role is what follows its content when the conversation ends there (no generation prompt).
    """
    role_of = {MARK.format("S"): "system", MARK.format("U"): "user"}
    messages = [{"role": role_of[left], "content": left}]
    ended = _render(template, messages, False, special)
    suffix = ended[ended.index(left) + len(left) :]
    if not gap.startswith(suffix):
        raise ValueError
    return suffix, gap[len(suffix) :]


def modelfile(gguf_name: str, template: str, stops: list[str], context: int) -> str:
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""', f"PARAMETER num_ctx {context}"]
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- model cards

BUNDLED_BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
TAGS = {"gguf": ["gguf"], "gptq": ["gptq"], "awq": ["awq"], "compressed-tensors": ["compressed-tensors"]}


def _chat_template(source_dir: Path) -> tuple[str | None, dict]:
    """The source's chat template and special tokens, read from its files (no tokenizer load)."""
    config_path = source_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    template = config.get("chat_template")
    if template is None and (source_dir / "chat_template.jinja").exists():
        template = (source_dir / "chat_template.jinja").read_text()
    special = {name: config.get(name) for name in ("bos_token", "eos_token")}
    return (template if isinstance(template, str) else None), special


def _front_matter(values: dict) -> str:
    lines = ["---"]
    for key, value in values.items():
        if isinstance(value, list):
            lines.append(f"{key}:")
            lines += [f"- {item}" for item in value]
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines + ["---", ""])


def _evaluation_rows(card: dict, entry: dict) -> list[str]:
    reference = card["reference"]
    metrics = entry["metrics"]
    rows = [
        "| metric | reference | this model |",
        "|---|---|---|",
        f"| perplexity ({card['evaluation']['text']['name']}, {card['evaluation']['context']} tokens) | "
        f"{reference['perplexity']:.3f} | {metrics['perplexity']:.3f} ({metrics['perplexity_increase_pct']:+.2f}%) |",
        f"| mean KL divergence | 0 | {metrics['kld_mean']:.4f} |",
        f"| top-1 agreement | 1 | {metrics['top1_agreement']:.3f} |",
    ]
    for name, task in (entry.get("tasks") or {}).items():
        base = reference["tasks"][name]["value"]
        rows.append(f"| {name} ({task['metric']}, {task['samples']} examples) | {base:.3f} | {task['value']:.3f} |")
    return rows


def model_card(card: dict, entry: dict, usage: list[str]) -> str:
    model = card["model"]
    base = model.get("hub_id") or BUNDLED_BASE_MODELS.get(model["name"]) or model["name"]
    quant_method = entry.get("quant_method", "gguf")
    front = {
        "base_model": base,
        "base_model_relation": "quantized",
        "library_name": "gguf" if entry["family"] == "gguf" else "transformers",
        "tags": ["quantforge", "quantized", *TAGS.get(quant_method, [quant_method]), entry["format"]],
        "quantized_by": "quantforge",
    }
    lines = [
        _front_matter(front),
        f"# {model['name']} {entry['scheme']}",
        "",
        f"{entry['scheme']} quantization of {f'[{base}](https://huggingface.co/{base})' if '/' in base else base} "
        "made with quantforge "
        f"({entry['backend']} backend): {entry['bits_per_weight']:.2f} bits per weight over all tensors, "
        f"{entry['size_bytes'] / 1e6:.1f} MB.",
        "",
        "## Evaluation",
        "",
        *_evaluation_rows(card, entry),
        "",
        "Measured by quantforge on the files in this folder, on the same tokens as the unquantized reference "
        "(see card.json of the run for how each figure was made).",
        "",
        "## Usage",
        "",
        *usage,
        "",
    ]
    return "\n".join(lines)


def write_deployment_files(run_dir: Path, card: dict) -> None:
    """README.md (model card) in every artifact folder; for GGUF an Ollama Modelfile, for vLLM formats the
    serve command. The files depend on measurements only, not on the card's targets."""
    from .fsutil import atomic_write_text

    source_dir = Path(card["model"]["path"])
    template, special = _chat_template(source_dir)
    targets = card["targets"]
    for entry in card["formats"]:
        if not entry.get("complete"):
            continue
        folder = run_dir / entry["artifact"]
        if entry["family"] == "gguf":
            gguf_name = next(folder.glob("*.gguf")).name
            usage = ["```bash", llama_cpp_command(gguf_name, targets["context"])]
            if template:
                try:
                    go_template, stops = chat_template_to_ollama(template, special)
                    atomic_write_text(
                        folder / "Modelfile", modelfile(gguf_name, go_template, stops, targets["context"])
                    )
                    usage.append(f"ollama create {card['model']['name']}-{entry['format']} -f Modelfile")
                except QuantforgeError as exc:
                    usage.append(f"# no Modelfile: {exc}")
            usage.append("```")
        else:
            quant = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
            entry = {**entry, "quant_method": quant.get("quant_method")}
            fit = next(iter(entry.get("memory_fit", {}).values()), None) if targets.get("gpu") else None
            max_len = fit["largest_context"] if fit and fit["largest_context"] else targets["context"]
            usage = [
                "```bash",
                vllm_command(folder.name, quant.get("quant_method"), max_len),
                "```",
                "",
                "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                f'model = AutoModelForCausalLM.from_pretrained("./{folder.name}", device_map="auto")',
                f'tokenizer = AutoTokenizer.from_pretrained("./{folder.name}")',
                "```",
            ]
        atomic_write_text(folder / "README.md", model_card(card, entry, usage))
