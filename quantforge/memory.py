"""Peak resident memory of one stage, measured by the kernel rather than sampled.

Linux keeps a process's high-water mark (``VmHWM``) and lets the process reset it (``/proc/self/clear_refs``), so a
stage's peak is read exactly and for free. Child processes (llama.cpp's converter, the speed probe) report theirs
through ``getrusage``: the largest child so far, so a stage's child peak is known when it raised that mark. A
quantizer's child reports its own high-water mark when it ends (``note_child_peak``).
Elsewhere (macOS, a kernel without clear_refs) the figures are None and nothing else changes.

On a GPU no such mark exists for the device, and a stage's GPU memory is held by a child as often as by this
process, so ``GpuWatch`` samples the device's used memory in a thread while a build runs (``watch_gpu``): each
stage's peak above what the device held when the build began, which is what the plan's GPU figures predict.
"""

from __future__ import annotations

import re
import resource
import threading
from collections.abc import Callable
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
        self.gpu_seen: int | None = None  # the device's used bytes at their highest while this stage ran
        _active.append(self)
        if _gpu_watch is not None:
            _gpu_watch.sample()
        return self

    def __exit__(self, *exc) -> None:
        self.gpu_peak_bytes: int | None = None
        if _gpu_watch is not None:
            _gpu_watch.sample()
            if self.gpu_seen is not None:
                self.gpu_peak_bytes = max(0, self.gpu_seen - _gpu_watch.baseline)
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
        if self.gpu_peak_bytes is not None:
            figures["gpu_peak_bytes"] = self.gpu_peak_bytes
        return figures


def note_child_peak(peak_bytes: int) -> None:
    """Tell the running stages the peak of a child they waited for, as the child read it (``getrusage`` gives only
    the largest child so far, which may be an earlier stage's, and counts the parent's size at the fork)."""
    for stage in _active:
        stage.child_noted = max(stage.child_noted or 0, peak_bytes)


class GpuWatch:
    """Samples a device's used memory (``read_used``, bytes) every ``interval`` seconds in a daemon thread and
    raises the mark of every running stage. Device-wide: it sees this process and its children alike (and, on a
    shared GPU, other users' processes too). ``baseline`` is the first reading, the device as the build found it.
    Memory a stage held for less than an interval can be missed; torch's caching allocator keeps what a stage
    allocated reserved until it is released, so its peak stays visible."""

    def __init__(self, read_used: Callable[[], int], interval: float = 0.1):
        self.read_used = read_used
        self.interval = interval
        self.baseline = read_used()
        self.failed = False  # a reading failed: the watch stops, and the stages keep what they saw
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quantforge-gpu-watch", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        if self.failed:
            return
        try:
            used = int(self.read_used())
        except Exception:  # a broken device must not end the build from here: its stage fails on its own
            self.failed = True
            return
        for stage in list(_active):
            stage.gpu_seen = max(stage.gpu_seen or 0, used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and not self.failed:
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_gpu_watch: GpuWatch | None = None


def watch_gpu(read_used: Callable[[], int] | None) -> None:
    """Start (or, given None, stop) sampling the device's used memory for every stage from now on."""
    global _gpu_watch
    if _gpu_watch is not None:
        _gpu_watch.stop()
    _gpu_watch = None
    if read_used is not None:
        try:
            _gpu_watch = GpuWatch(read_used)
        except Exception:  # a device that cannot be read now fails the stage that uses it, with its own error
            _gpu_watch = None


def cuda_used_bytes(device: str) -> Callable[[], int]:
    """What a CUDA device holds in all, every process's memory and contexts included (the driver's view)."""
    import torch

    index = torch.device(device)

    def read() -> int:
        free, total = torch.cuda.mem_get_info(index)
        return int(total - free)

    return read


def release_freed_memory() -> None:
    """Collect cycles and hand freed heap memory back to the system (glibc keeps it otherwise: measured, a closed
    0.5B reference left 0.7 GB resident through every later stage of the build), and freed GPU memory back to the
    device: torch's caching allocator keeps it reserved otherwise, and the next stage's child (a quantizer, an
    artifact's runtime) could not have it."""
    import ctypes
    import gc
    import sys

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
    torch = sys.modules.get("torch")  # never imported for this: a build that has not used torch has no cache
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


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
