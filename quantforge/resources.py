"""Disk and memory checked before any long work, so a build is refused with the numbers instead of failing hours in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .errors import QuantforgeError

DISK_MARGIN = 1.10  # headroom for temporary names, logs and the card
REFERENCE_MEMORY_FACTOR = 1.3  # float32 weights plus activations and the library's own copies


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def planned_disk_bytes(parameters: int, nominal_bits: list[float], needs_f16_gguf: bool) -> int:
    artifacts = sum(parameters * bits / 8 for bits in nominal_bits)
    intermediate = parameters * 2 if needs_f16_gguf else 0
    return int((artifacts + intermediate) * DISK_MARGIN)


def check_resources(
    run_dir: Path, parameters: int, nominal_bits: list[float], needs_f16_gguf: bool, needs_reference_model: bool
) -> dict:
    """Refuse a build that cannot fit; return the numbers for the manifest."""
    needed_disk = planned_disk_bytes(parameters, nominal_bits, needs_f16_gguf)
    free_disk = shutil.disk_usage(_existing_parent(run_dir)).free
    if needed_disk > free_disk:
        raise QuantforgeError(
            f"not enough disk at {run_dir}: the planned artifacts need about {needed_disk / 1e9:.2f} GB and "
            f"{free_disk / 1e9:.2f} GB is free; free space or choose another --out"
        )
    needed_memory = int(parameters * 4 * REFERENCE_MEMORY_FACTOR) if needs_reference_model else 0
    available = available_memory_bytes()
    if available is not None and needed_memory > available and not os.environ.get("QUANTFORGE_IGNORE_MEMORY"):
        raise QuantforgeError(
            f"not enough memory: evaluating the float reference needs about {needed_memory / 1e9:.1f} GB and "
            f"{available / 1e9:.1f} GB is available; use a machine with more memory "
            "(or set QUANTFORGE_IGNORE_MEMORY=1 to try anyway)"
        )
    return {
        "disk_needed_bytes": needed_disk,
        "disk_free_bytes": free_disk,
        "memory_needed_bytes": needed_memory,
        "memory_available_bytes": available,
    }
