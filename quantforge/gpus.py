"""GPUs the card sizes formats for, and the memory-bandwidth roofline: decoding one token reads every weight once,
so decode speed is bounded by bandwidth / bytes of weights. GPU figures are vendors' published ones, never measured
here; the host's bandwidth is measured by ``probe.measure_bandwidth``."""

from __future__ import annotations

# name -> (memory GB, memory bandwidth GB/s), vendors' published figures
GPUS = {
    "H100": (80, 3350),
    "H200": (141, 4800),
    "A100": (80, 2039),
    "L40S": (48, 864),
    "RTX 4090": (24, 1008),
    "RTX 3090": (24, 936),
}


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
