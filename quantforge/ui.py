"""Progress bars and messages (rich, on stderr, so stdout stays clean for --json)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class UI:
    def __init__(self, quiet: bool = False):
        # A duplicate of stderr, so that logs.capture_output can send library output to a file while our
        # progress display stays on the terminal.
        terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
        self.console = Console(file=terminal, quiet=quiet, force_terminal=sys.stderr.isatty() or None)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )

    def __enter__(self) -> "UI":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def log(self, message: str) -> None:
        self.console.print(message, highlight=False)

    @contextlib.contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Callable[..., None]]:
        """A progress line; the yielded function sets how many units are done."""
        task_id = self.progress.add_task(description, total=total)

        def advance(done: int, new_total: int | None = None) -> None:
            if new_total is not None:
                self.progress.update(task_id, total=new_total)
            self.progress.update(task_id, completed=done)

        yield advance
        total = next(t.total for t in self.progress.tasks if t.id == task_id) or 1
        self.progress.update(task_id, total=total, completed=total)

    def skipped(self, description: str) -> None:
        self.console.print(f"[dim]✓ {description} (done earlier, inputs unchanged)[/dim]")
