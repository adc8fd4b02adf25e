"""The one place that decides where torch work runs: the reference, dequantized evaluation and torch quantizers.

``--device auto`` takes the first CUDA device torch can use, else the CPU; ``cuda`` / ``cuda:N`` insist on one and
fail in one line when it is not there. llama.cpp's device is its own build's (``install.sh`` builds it with CUDA when
``nvcc`` is present) and is not chosen here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from .errors import QuantforgeError

CHOICES = "auto, cpu, cuda or cuda:N"


def _nvidia_driver_present() -> bool:
    # Cheap, and spares a CPU-only machine the torch import that asking torch would cost.
    return Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi") is not None


def _cuda_devices() -> tuple[int, str]:
    """(how many CUDA devices torch can use, torch's version) ."""
    import torch

    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), torch.__version__


def resolve_device(choice: str | None) -> str:
    """'cpu' or 'cuda:N' for a --device value; a clear one-line error for one that cannot be had."""
    choice = (choice or "auto").strip().lower()
    if choice == "cpu":
        return "cpu"
    if choice == "auto":
        if not _nvidia_driver_present():
            return "cpu"
        count, _ = _cuda_devices()
        return "cuda:0" if count else "cpu"
    match = re.fullmatch(r"cuda(?::(\d+))?", choice)
    if not match:
        raise QuantforgeError(f"--device must be {CHOICES}, not {choice!r}")
    index = int(match.group(1) or 0)
    count, version = _cuda_devices()
    if count == 0:
        why = "a CPU-only build" if "+cpu" in version else "no usable NVIDIA GPU or driver"
        raise QuantforgeError(
            f"--device {choice}: torch {version} sees no CUDA device ({why}); use --device cpu, or install the "
            "CUDA build of torch on a machine with an NVIDIA GPU (scripts/install.sh does when nvidia-smi works)"
        )
    if index >= count:
        raise QuantforgeError(f"--device {choice}: torch sees {count} CUDA device(s), numbered 0 to {count - 1}")
    return f"cuda:{index}"
