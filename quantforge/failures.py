"""A format whose library fails is a failed format, not a crashed build: how such a failure is told and recorded.

The record goes into the run's manifest (``failures``) and onto the card; it is not a stage, so the same command
runs the failed stages again while every finished one is kept.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from .errors import DISK_ERRORS, QuantforgeError


def is_environment_error(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in DISK_ERRORS)


def library_of(exc: BaseException, default: str) -> str:
    """The library (with its version) whose code raised ``exc``: the innermost frame of its traceback that is
    neither quantforge's nor the standard library's (transformers for a failure inside transformers' model code,
    torch for a bad call of ours that torch's module machinery made), or ``default`` when none is."""
    from .backends import library_version

    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    for frame in reversed(frames):
        top = frame.f_globals.get("__name__", "").split(".")[0]
        if top and top not in ("quantforge", "__main__") and top.lstrip("_") not in sys.stdlib_module_names:
            return library_version(top)
    return default


def last_line(exc: BaseException) -> str:
    """The exception as one line: its type and the last line of its message (ours need no type)."""
    if isinstance(exc, QuantforgeError):
        return str(exc)
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    line = text[-1] if text else type(exc).__name__
    if ":" not in line and str(exc).strip():
        line = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
    return " ".join(line.split())[:400]


def shown_path(log: Path) -> Path:
    """A log's path as the user typed their way to it: relative to the working directory when under it."""
    try:
        return log.relative_to(Path.cwd())
    except ValueError:
        return log


def describe_failure(key: str, stage: str, library: str, exc: BaseException, log: Path, run_dir: Path) -> dict:
    """Write the traceback to ``log`` and return the failure record with its one line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as handle:
        handle.write(f"\nquantforge: {stage} of {key} failed in {library}\n")
        handle.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    shown = shown_path(log)
    error = last_line(exc)
    return {
        "key": key,
        "stage": stage,
        "library": library,
        "error": error,
        "log": str(log.relative_to(run_dir)),
        "line": f"{key}: {stage} failed in {library}: {error} (log: {shown})",
    }


def unsupported_record(key: str, library: str, reason: str) -> dict:
    """A format refused up front because its library cannot handle the model."""
    return {
        "key": key,
        "stage": "check",
        "library": library,
        "error": reason,
        "log": None,
        "line": f"{key}: not made: {reason}",
    }
