"""Library output (per-tensor lines, banners, tables) goes to a log file in the run, not to the terminal."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def capture_output(path: Path) -> Iterator[None]:
    """Redirect file descriptors 1 and 2 (C libraries and Python alike) into ``path`` for the duration.

    quantforge's own progress display writes to a duplicate of the original stderr (see ui.UI), so it stays on
    the terminal while this is active.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@contextlib.contextmanager
def follow_progress(path: Path, pattern: str | None, report: Callable[[int, int], None]) -> Iterator[None]:
    """Turn a library's own progress lines in its log ("Quantizing layer 7 of 29") into our progress bar.

    ``pattern`` has two groups, (done, total); the last match in the log wins.
    """
    if not pattern:
        yield
        return
    regex = re.compile(pattern.encode())
    stop = threading.Event()

    def poll():
        offset = 0
        while not stop.wait(0.5):
            try:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
            except OSError:
                continue
            offset += len(chunk)
            matches = regex.findall(chunk)
            if matches:
                done, total = (int(x) for x in matches[-1])
                report(done, total)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_logged(command: list[str], log_path: Path, what: str, cwd: Path | None = None) -> str:
    """Run a program with its output appended to ``log_path``; return the output, or raise a one-line error that
    names ``what`` failed, its exit status, its last line and the log to read."""
    import subprocess

    from .errors import QuantforgeError

    log_path.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, errors="replace", cwd=cwd)
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise QuantforgeError(f"{what} failed (exit {done.returncode}): {lines[-1] if lines else ''}; see {log_path}")
    return done.stdout + done.stderr
