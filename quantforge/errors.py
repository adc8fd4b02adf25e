"""The error types users see: a single line that says what was wrong and what to do.

Exit codes of ``quantforge build`` (and ``release``): 0 everything made and measured; 2 bad input or environment,
refused before or without touching what was already produced; 3 some formats failed inside their library (the
others were finished, the card lists each failure, and the same command retries only what failed); 130 interrupted.
"""

EXIT_BAD_INPUT = 2
EXIT_FORMATS_FAILED = 3
EXIT_INTERRUPTED = 130


class QuantforgeError(Exception):
    """A problem with the user's input or environment; the CLI prints it on one line and exits 2."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str):
        # Keep the message on one line: CLI output and logs are read by people and by grep.
        super().__init__(" ".join(str(message).split()))


class StageFailed(QuantforgeError):
    """A library raised inside a stage: one line naming the stage, the library and version, its error, the log."""

    exit_code = EXIT_FORMATS_FAILED

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record or {}
