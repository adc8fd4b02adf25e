"""The one error type users see: a single line that says what was wrong and what to do."""


class QuantforgeError(Exception):
    """A problem with the user's input or environment; the CLI prints it on one line and exits 2."""

    exit_code = 2

    def __init__(self, message: str):
        # Keep the message on one line: CLI output and logs are read by people and by grep.
        super().__init__(" ".join(str(message).split()))
