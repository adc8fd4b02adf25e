"""What the build's child processes share: starting one with a pipe for its messages, telling how one ended when
it gave no answer, and carrying an exception back across the pipe as one line.

Two kinds of work run in children, so that whatever ends a process ends one format only: each format's quantizer
(``quantize_process``) and the runtime that evaluates each artifact (``runner_process``). The parent writes to the
child's stdin and reads JSON lines from a pipe of its own; the child's stdout and stderr are the parent's, which
the pipeline has pointed at the format's log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

from .errors import QuantforgeError

# How many lines at the end of the log are searched for the reason a child gave before it exited.
LOG_TAIL_LINES = 200


def start_child(module: str, pass_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen, BinaryIO]:
    """``python -m module <message fd>`` with a pipe on its stdin (its job comes that way); returns it and the end
    its messages come out of. ``pass_fds`` are further descriptors the child inherits."""
    read_end, write_end = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(write_end)],
            stdin=subprocess.PIPE,
            pass_fds=(write_end, *pass_fds),
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return process, os.fdopen(read_end, "rb")


def end_child(process: subprocess.Popen) -> None:
    """Kill the child unless it has already ended, and reap it."""
    if process.returncode is None:
        process.kill()
        process.wait()


def child_messages(fd: int):
    """In the child: ``send(message)`` writes one JSON line to the parent's pipe."""
    messages = os.fdopen(fd, "w")

    def send(message: dict) -> None:
        messages.write(json.dumps(message) + "\n")
        messages.flush()

    return send


def how_it_ended(returncode: int, log_path: Path, whose: str = "the quantizer's process") -> str:
    """One line for a child that ended without an answer: the signal or exit status, and why where it is known."""
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else f"signal {-returncode}"
        if -returncode == signal.SIGKILL:
            return (
                f"{whose} was killed ({name}), most likely by the system for lack of memory; "
                "see --plan-only for what each stage needs, or use a machine with more memory"
            )
        return f"{whose} was ended by {name}"
    reason = last_error_line(log_path)
    said = f": {reason}" if reason else ""
    return f"{whose} exited with status {returncode} before it finished{said}"


def last_error_line(log_path: Path) -> str | None:
    """The last line of a Python traceback in the log (``ValueError: ...``), the reason a library gave before it
    ended the process itself (GPTQModel prints the traceback, then calls os._exit)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return None
    in_traceback = False
    reason = None
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line.startswith((" ", "\t")):
            reason, in_traceback = " ".join(line.split())[:400], False
    return reason


def error_record(exc: BaseException) -> dict:
    """An exception in the child as JSON for the parent (``rebuilt_error``)."""
    from .failures import is_environment_error, last_line

    return {"line": last_line(exc), "environment": is_environment_error(exc), "errno": getattr(exc, "errno", None)}


def rebuilt_error(error: dict) -> Exception:
    """The child's exception as one the pipeline treats the same way (failures.is_environment_error): a full disk
    or exhausted memory still stops the build, anything else fails the format."""
    line = error["line"]
    if error.get("environment"):
        return OSError(error["errno"], line) if error.get("errno") else MemoryError(line)
    return QuantforgeError(line)


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when the build that started it dies (killed with SIGKILL, say),
    so no orphan goes on writing into a run that a later build has taken over."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
