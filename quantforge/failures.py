"""A format whose library fails is a failed format, not a crashed build: how such a failure is told and recorded.

The record goes into the run's manifest (``failures``) and onto the card; it is not a stage, so the same command
runs the failed stages again while every finished one is kept.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from .errors import DISK_ERRORS, QuantforgeError


def is_environment_error(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in DISK_ERRORS)


def last_line(exc: BaseException) -> str:
    """The exception as one line: its type and the last line of its message (ours need no type)."""
    if isinstance(exc, QuantforgeError):
        return str(exc)
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    line = text[-1] if text else type(exc).__name__
    if ":" not in line and str(exc).strip():
        line = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
    return " ".join(line.split())[:400]


def describe_failure(key: str, stage: str, library: str, exc: BaseException, log: Path, run_dir: Path) -> dict:
    """Write the traceback to ``log`` and return the failure record with its one line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as handle:
        handle.write(f"\nquantforge: {stage} of {key} failed in {library}\n")
        handle.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    try:
        shown = log.relative_to(Path.cwd())
    except ValueError:
        shown = log
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
