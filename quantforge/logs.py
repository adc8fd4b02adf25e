"""Library output (per-tensor lines, banners, tables) goes to a log file in the run, not to the terminal."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator


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
