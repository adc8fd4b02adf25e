"""GPUs the card sizes formats for, and the memory-bandwidth roofline: decoding one token reads every weight once,
so decode speed is bounded by bandwidth / bytes of weights. GPU figures are vendors' published ones, never measured
here; the host's bandwidth is measured by ``probe.measure_bandwidth``."""

from __future__ import annotations

# name -> (memory GB, memory bandwidth GB/s), vendors' published figures
GPUS = {
    "B200": (180, 8000),
    "H200": (141, 4800),
    "H100": (80, 3350),
    "H100 PCIe": (80, 2000),
    "A100": (80, 2039),
    "L40S": (48, 864),
    "RTX 5090": (32, 1792),
    "RTX 4090": (24, 1008),
    "RTX 3090": (24, 936),
    "A10G": (24, 600),
    "L4": (24, 300),
    "T4": (16, 320),
}
# Each GPU's generation: which quantized kernels it has (Format.gpu_generations says where a format runs).
GENERATIONS = ("turing", "ampere", "ada", "hopper", "blackwell")
GENERATION = {
    "B200": "blackwell",
    "RTX 5090": "blackwell",
    "H200": "hopper",
    "H100": "hopper",
    "H100 PCIe": "hopper",
    "L40S": "ada",
    "RTX 4090": "ada",
    "L4": "ada",
    "A100": "ampere",
    "RTX 3090": "ampere",
    "A10G": "ampere",
    "T4": "turing",
}


def kernels_run(generation: str | None, runs: tuple[str, ...], weights_alone: tuple[str, ...]) -> str:
    """How vLLM's kernels run a format on a GPU of ``generation``: "as made", "weights alone" or "no". A format
    that names no generations runs everywhere; a GPU of unknown generation (a bare memory size) is taken to run it.
    ``runs`` and ``weights_alone`` are the format's ``gpu_generations`` and ``gpu_weight_only``."""
    if generation in weights_alone:
        return "weights alone"
    if not runs or generation is None or generation in runs:
        return "as made"
    return "no"


def roofline(weight_bytes: int, bandwidth_gbs: float) -> float:
    """Upper bound on decode tokens/s when every weight is read once per token."""
    return bandwidth_gbs * 1e9 / weight_bytes


def gpu_rooflines(weight_bytes: int) -> dict:
    return {
        name: {
            "memory_gb": memory,
            "bandwidth_gbs": bandwidth,
            "decode_tps_bound": roofline(weight_bytes, bandwidth),
            "fits": weight_bytes < memory * 1e9,
            "computed": True,
        }
        for name, (memory, bandwidth) in GPUS.items()
    }


def published_bandwidth(device_name: str) -> tuple[str, float] | None:
    """(our name, GB/s) of the table's GPU that a device's own name (``torch.cuda.get_device_name``, e.g. "NVIDIA
    H100 80GB HBM3") names, the longest such name first; None for a GPU the table lacks."""
    spoken = device_name.upper()
    for name in sorted(GPUS, key=len, reverse=True):
        if name.upper() in spoken:
            return name, float(GPUS[name][1])
    return None


def cuda_device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def device_roofline(device: str, weight_bytes: int, speed: dict, device_name: str | None = None) -> dict:
    """The roofline of the device a probe ran on, and the measured decode speed's fraction of it: the host's
    measured bandwidth for the CPU; for a CUDA device, the published bandwidth of the GPU its name names (none for
    a GPU the table lacks: then no fraction, rather than one against the wrong memory)."""
    if not device.startswith("cuda"):
        bound, facts = speed["host_decode_tps_bound"], {"device": "cpu", "bound_source": "host bandwidth, measured"}
    else:
        name = device_name or cuda_device_name(device)
        known = published_bandwidth(name)
        bound = roofline(weight_bytes, known[1]) if known else None
        source = f"{known[0]}'s published bandwidth, {known[1]:.0f} GB/s" if known else "not in quantforge's GPU table"
        facts = {"device": device, "device_name": name, "bound_source": source}
    fraction = speed["decode_tps"] / bound if bound else None
    return {**facts, "decode_tps_bound": bound, "fraction_of_roofline": fraction}
