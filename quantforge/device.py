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


def cuda_index(device: str) -> int | None:
    """N of a resolved 'cuda:N'; None for the CPU."""
    return int(device.partition(":")[2] or 0) if device.startswith("cuda") else None


# llama.cpp's LLAMA_SPLIT_MODE_NONE: the whole model on main_gpu. Its default (by layer) spreads the layers over
# every visible GPU, which --device cuda:N does not ask for.
LLAMA_SPLIT_MODE_NONE = 0


def llama_gpu_params(device: str, offloads: bool) -> dict:
    """llama-cpp-python's ``Llama`` arguments that put every layer on ``device``'s GPU (none for the CPU, or a
    llama.cpp built without GPU offload)."""
    index = cuda_index(device)
    if index is None or not offloads:
        return {"n_gpu_layers": 0}
    return {"n_gpu_layers": -1, "split_mode": LLAMA_SPLIT_MODE_NONE, "main_gpu": index}


def llama_tool_gpu_args(device: str) -> list[str]:
    """The same for llama.cpp's command-line tools (common/arg.cpp: -ngl, -sm, -mg)."""
    index = cuda_index(device)
    return [] if index is None else ["-ngl", "999", "-sm", "none", "-mg", str(index)]


def visible_devices_for(device: str, environ: dict) -> str | None:
    """CUDA_VISIBLE_DEVICES that leaves a runtime which always takes the first GPU it sees (vLLM) only ``device``;
    'cuda:N' counts among the GPUs this process sees, which a CUDA_VISIBLE_DEVICES already set may have narrowed."""
    index = cuda_index(device)
    if index is None:
        return None
    current = environ.get("CUDA_VISIBLE_DEVICES")
    if current is None or current.strip() == "":
        return str(index)
    seen = [entry.strip() for entry in current.split(",") if entry.strip()]
    return seen[index] if index < len(seen) else str(index)


# CPU flags of native bf16 multiplies. Without them torch's bf16 matrix multiply on a CPU is emulated: measured on
# this project's AVX2 host, 18.7 GFLOP/s against 160 in float32 (2 threads, a 256x576 by 576x1536 linear).
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_multiplies_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU has bf16 multiply instructions; None where its flags cannot be read (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(CPU_BF16_FLAGS & set(line.partition(":")[2].split()))
    return None


def quantizer_dtype(requested: str, device: str, cpu_bf16: bool | None, float32_fits: bool) -> tuple[str, str]:
    """(dtype, why) of GPTQModel's GPTQ arithmetic. Its AWQ packs only from 16 bits, and llm-compressor's formats
    stay in bf16 too: cast back to bf16 before saving, 0.66% of its int8 weights rounded to a neighbouring integer
    (SmolLM2-135M), where GPTQModel saves the integers it computed.

    ``auto`` is bfloat16 on a GPU and on a CPU with bf16 instructions. On a CPU without them float32 when the
    resource plan's float32 peak fits in free memory (``float32_fits``): GPTQ's calibration there ran 4.2x faster
    a token (SmolLM2-135M, 2 threads). The tensors left unquantized are saved in bf16 either way, so the
    artifact's layout does not change.
    """
    if requested != "auto":
        return requested, "asked for"
    if device.startswith("cuda"):
        return "bfloat16", "the GPU multiplies bf16 natively"
    if cpu_bf16 or cpu_bf16 is None:
        return "bfloat16", "this CPU multiplies bf16 natively" if cpu_bf16 else "this CPU's flags could not be read"
    if not float32_fits:
        return "bfloat16", "float32 weights would not fit in this host's free memory"
    return "float32", "this CPU has no bf16 instructions: torch emulates bf16 multiplies there, about 4x slower"
