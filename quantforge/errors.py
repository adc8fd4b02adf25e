"""The error types users see: a single line that says what was wrong and what to do.

Exit codes of ``quantforge build`` (and ``release``): 0 everything made and measured; 2 bad input or environment,
refused before or without touching what was already produced; 3 some formats failed inside their library (the
others were finished, the card lists each failure, and the same command retries only what failed); 4 with
``--require-recommendation``, when every format was made and measured and none meets the targets; 130 interrupted.
"""

import contextlib
import errno
import signal
import threading

EXIT_BAD_INPUT = 2
EXIT_FORMATS_FAILED = 3
EXIT_NO_RECOMMENDATION = 4
EXIT_INTERRUPTED = 130


# Errors of the machine, not of the input or of a format: the CLI names them in one line, and they stop a build
# even inside a format's stage (see failures.is_environment_error).
DISK_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}
DISK_ADVICE = {
    errno.ENOSPC: "free space or choose another --out",
    errno.EDQUOT: "free space or choose another --out",
    errno.EROFS: "choose a writable --out",
    errno.EACCES: "choose a writable --out",
}


class QuantforgeError(Exception):
    """A problem with the user's input or environment; the CLI prints it on one line and exits 2."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, from_library: bool = False):
        # Keep the message on one line: CLI output and logs are read by people and by grep.
        super().__init__(" ".join(str(message).split()))
        # Told in our words, but the failure is a library's (a child process's), not the user's input: a stage
        # that can go on without the figure records it instead of stopping the build (pipeline.shared_stage).
        self.from_library = from_library


class StageFailed(QuantforgeError):
    """A library raised inside a stage: one line naming the stage, the library and version, its error, the log."""

    exit_code = EXIT_FORMATS_FAILED

    def __init__(self, message: str, record: dict | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.record = record or {}
        if exit_code is not None:  # a stage every format needs (the reference): nothing could be measured
            self.exit_code = exit_code


@contextlib.contextmanager
def interrupts_kept():
    """Ctrl-C inside a library call stops the build even when the library swallows it.

    GPTQModel 7.6 catches BaseException around torch.compile and in its worker threads, so a KeyboardInterrupt
    raised there was dropped and the quantization ran on to a finished artifact (exit 0). While this block runs,
    SIGINT is noted as well as raised, and the note is raised again as KeyboardInterrupt when the call returns.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread (a Ray worker's task runs elsewhere)
        return
    noted: list[int] = []
    previous = signal.getsignal(signal.SIGINT)

    def note_and_raise(signum, frame):
        noted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note_and_raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if noted:
        raise KeyboardInterrupt


def one_line(exc: BaseException) -> str:
    """ "TypeName: first line of the message": how a library's exception is named in a one-line error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
