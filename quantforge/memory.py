"""Peak resident memory of one stage, measured by the kernel rather than sampled.

Linux keeps a process's high-water mark (``VmHWM``) and lets the process reset it (``/proc/self/clear_refs``), so a
stage's peak is read exactly and for free. Child processes (llama.cpp's converter, the speed probe) report theirs
through ``getrusage``: the largest child so far, so a stage's child peak is known when it raised that mark. A
quantizer's child reports its own high-water mark when it ends (``note_child_peak``).
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
        self.child_noted: int | None = None  # a child's own peak, given by whoever waited for it
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        current = _high_water_bytes() if self.resettable else None
        self.peak_rss_bytes = max(self.seen or 0, current or 0) or None
        after = _children_peak_bytes()
        self.child_peak_rss_bytes = after if after > self.children_before else None
        if self.child_noted:  # exact, where getrusage's may be the parent's own size copied at the fork
            self.child_peak_rss_bytes = self.child_noted

    def to_json(self) -> dict:
        figures = {"peak_rss_bytes": self.peak_rss_bytes, "child_peak_rss_bytes": self.child_peak_rss_bytes}
        if self.child_noted and self.peak_rss_bytes:
            # The stage's work ran in a child while this process waited beside it: the host held both.
            figures["host_peak_rss_bytes"] = self.peak_rss_bytes + self.child_noted
        return figures


def note_child_peak(peak_bytes: int) -> None:
    """Tell the running stages the peak of a child they waited for, as the child read it (``getrusage`` gives only
    the largest child so far, which may be an earlier stage's, and counts the parent's size at the fork)."""
    for stage in _active:
        stage.child_noted = max(stage.child_noted or 0, peak_bytes)


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


# Packages transformers imports whenever they are installed, for features nothing here uses, and the transformers
# module that imports each. Measured in a process that loads SmolLM2-135M: scikit-learn (lm-eval depends on it; it
# brings pandas, pyarrow and joblib) 136 MB resident and a second of start-up, 73 MB where ``datasets`` already
# brought pandas; scipy (for object-detection losses) 36 MB and 0.4 s; torchao (GPTQModel depends on it, for its
# FP4 kernels) 13 MB beyond the torch modules that loading a model imports anyway.
UNUSED_BY_TRANSFORMERS = {
    "sklearn": "transformers.generation.candidate_generator",  # one option of assisted generation
    "scipy": "transformers.modeling_utils",  # object-detection losses (loss_for_object_detection)
    "torchao": "transformers.quantizers.auto",  # loading torchao-quantized checkpoints
}


def import_transformers_slim() -> None:
    """Import the transformers modules that every model class pulls in with the packages in
    ``UNUSED_BY_TRANSFORMERS`` reported absent, so that loading a model does not load them.

    transformers then behaves as where they are not installed (its ``is_*_available`` answers are cached for the
    process); none of the libraries we run asks transformers about them. The packages stay importable: lm-eval's
    metrics import scikit-learn (and it scipy) and GPTQModel imports torchao themselves. A package already imported,
    or whose transformers module is, is left alone.
    """
    import importlib
    import sys

    blocked = [
        package
        for package, module in UNUSED_BY_TRANSFORMERS.items()
        if package not in sys.modules and module not in sys.modules
    ]
    for package in blocked:
        sys.modules[package] = None  # importlib.util.find_spec answers None for it: "not installed"
    try:
        for package in blocked:
            try:
                importlib.import_module(UNUSED_BY_TRANSFORMERS[package])
            except ImportError:  # a transformers laid out otherwise: it imports as it would have
                pass
    finally:
        for package in blocked:
            if sys.modules.get(package, 0) is None:
                del sys.modules[package]
