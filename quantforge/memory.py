"""Peak resident memory of one stage, measured by the kernel rather than sampled.

Linux keeps a process's high-water mark (``VmHWM``) and lets the process reset it (``/proc/self/clear_refs``), so a
stage's peak is read exactly and for free. Child processes (llama.cpp's converter, the speed probe) report theirs
through ``getrusage``: the largest child so far, so a stage's child peak is known when it raised that mark.
Elsewhere (macOS, a kernel without clear_refs) the figures are None and nothing else changes.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")
_active: list["StagePeak"] = []


def _high_water_bytes() -> int | None:
    try:
        match = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_high_water() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _children_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # kB on Linux


class StagePeak:
    """``with StagePeak() as peak: ...`` then ``peak.to_json()``; stages may nest."""

    def __enter__(self) -> "StagePeak":
        current = _high_water_bytes()
        for outer in _active:  # the reset below would hide what the outer stages reached so far
            outer.seen = max(outer.seen or 0, current or 0)
        self.resettable = _reset_high_water()
        self.seen: int | None = None
        self.children_before = _children_peak_bytes()
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        current = _high_water_bytes() if self.resettable else None
        self.peak_rss_bytes = max(self.seen or 0, current or 0) or None
        after = _children_peak_bytes()
        self.child_peak_rss_bytes = after if after > self.children_before else None

    def to_json(self) -> dict:
        return {"peak_rss_bytes": self.peak_rss_bytes, "child_peak_rss_bytes": self.child_peak_rss_bytes}


def release_freed_memory() -> None:
    """Collect cycles and hand freed heap memory back to the system (glibc keeps it otherwise: measured, a closed
    0.5B reference left 0.7 GB resident through every later stage of the build)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def import_transformers_without_sklearn() -> None:
    """Import transformers' generation code (which every model and tokenizer class pulls in) with scikit-learn
    reported absent.

    transformers imports ``sklearn.metrics`` at that point whenever scikit-learn is installed (lm-eval depends on
    it), for one option of assisted generation that nothing here uses; scikit-learn brings pandas, pyarrow and
    joblib. Measured: 136 MB resident in a process that loads a model (73 MB where ``datasets`` already brought
    pandas) and a second of start-up. scikit-learn stays importable afterwards (lm-eval's metrics import it
    themselves). Does nothing when scikit-learn or that module is already imported.
    """
    import sys

    if "sklearn" in sys.modules or "transformers.generation.candidate_generator" in sys.modules:
        return
    sys.modules["sklearn"] = None  # importlib.util.find_spec answers None for it: "not installed"
    try:
        import transformers.generation.candidate_generator  # noqa: F401
    except ImportError:  # a transformers laid out otherwise: it imports as it would have
        pass
    finally:
        if sys.modules.get("sklearn", 0) is None:
            del sys.modules["sklearn"]
