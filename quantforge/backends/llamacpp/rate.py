"""llama.cpp's own matrix-multiply rate on this host, for the resource plan's llama.cpp stages.

The plan's torch stages are timed against numpy's float32 GEMM rate, but llama.cpp's quantized kernels do not keep
step with it across CPUs: llama.cpp is built for AVX2 everywhere (scripts/install.sh), while numpy and torch use
AVX-512 where the CPU has it. A prediction fitted on one host against numpy's rate was 1.4-1.9x too long on another
(docs/design.md). So the plan measures ggml's CPU kernel itself: one Q8_0 x float32 multiply of a 1B-class layer's
shape, the operation that dominates llama.cpp's evaluation.

The measurement runs in a child process that loads llama-cpp-python's ggml libraries through ctypes (no import of
llama_cpp): a library that differs from the one this was written against can only fail the child, and the plan
then falls back to numpy's rate.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

Q8_0 = 8  # ggml_type
WIDTH, ROWS, COLUMNS = 1024, 2816, 128  # one feed-forward projection of a 1B-class model, a block of 128 positions
# On a shared host one measurement's rate swung 63-157 GFLOP/s between builds while the multiplies within it agreed
# to 1-2%: the host was busy for a moment, not the multiply noisy. So the time is spent in bursts a moment apart,
# and the fastest burst's median is the rate (a build runs for minutes, mostly outside such a moment).
BURSTS = 3
BURST_GAP = 0.15  # seconds between bursts


def ggml_library_dir() -> Path | None:
    """The folder of llama-cpp-python's ggml libraries, found without importing llama_cpp."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "lib"
    return folder if (folder / "libggml-base.so").exists() and (folder / "libggml-cpu.so").exists() else None


def ggml_offloads_to_cuda() -> bool:
    """Whether the installed llama.cpp was built with CUDA (its libggml-cuda beside the CPU library), found without
    importing llama_cpp: the backend then puts every layer on the chosen GPU."""
    folder = ggml_library_dir()
    return folder is not None and any(folder.glob("libggml-cuda.so*"))


def _measure_in_this_process(library_dir: Path | str, seconds: float, bursts: int = BURSTS) -> float:
    """One thread's GFLOP/s for a Q8_0 weight matrix times float32 activations: the best of ``bursts`` medians of
    repeated multiplies, the bursts ``BURST_GAP`` seconds apart."""
    import ctypes
    import time

    import numpy as np

    library_dir = Path(library_dir)
    base = ctypes.CDLL(str(library_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(library_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.restype, base.ggml_init.argtypes = pointer, [InitParams]
    base.ggml_new_tensor_2d.restype, base.ggml_new_tensor_2d.argtypes = pointer, [pointer, ctypes.c_int, int64, int64]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = pointer, [pointer]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, pointer, pointer, int64, int64, int64, pointer]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = pointer, [pointer, pointer, pointer]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = pointer, [pointer]
    base.ggml_build_forward_expand.argtypes = [pointer, pointer]
    base.ggml_free.argtypes = [pointer]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [pointer, pointer, ctypes.c_int]
    if hasattr(cpu, "ggml_cpu_init"):
        cpu.ggml_cpu_init()

    rng = np.random.default_rng(0)
    weights = rng.standard_normal((ROWS, WIDTH), dtype=np.float32)
    activations = rng.standard_normal((COLUMNS, WIDTH), dtype=np.float32)
    context = base.ggml_init(InitParams(weights.nbytes + 4 * activations.nbytes + (16 << 20), None, False))
    try:
        w = base.ggml_new_tensor_2d(context, Q8_0, WIDTH, ROWS)
        x = base.ggml_new_tensor_2d(context, 0, WIDTH, COLUMNS)
        base.ggml_quantize_chunk(Q8_0, weights.ctypes.data, base.ggml_get_data(w), 0, ROWS, WIDTH, None)
        ctypes.memmove(base.ggml_get_data(x), activations.ctypes.data, activations.nbytes)
        product = base.ggml_mul_mat(context, w, x)
        graph = base.ggml_new_graph(context)
        base.ggml_build_forward_expand(graph, product)
        medians = []
        for burst in range(bursts):
            if burst:
                time.sleep(BURST_GAP)
            times = []
            deadline = time.perf_counter() + seconds / bursts
            while time.perf_counter() < deadline or len(times) < 3:
                start = time.perf_counter()
                if cpu.ggml_graph_compute_with_ctx(context, graph, 1) != 0:
                    raise RuntimeError("ggml_graph_compute failed")
                times.append(time.perf_counter() - start)
            medians.append(float(np.median(times)))
        result = ctypes.cast(base.ggml_get_data(product), ctypes.POINTER(ctypes.c_float))
        got = np.ctypeslib.as_array(result, shape=(COLUMNS, ROWS))
        expected = activations @ weights.T
        # Q8_0 rounds weights and activations to 8 bits: a wrong layout would be off by far more than 5%.
        if not np.abs(got - expected).max() <= 0.05 * np.abs(expected).max():
            raise RuntimeError("ggml's product disagrees with numpy's")
    finally:
        base.ggml_free(context)
    return 2 * WIDTH * ROWS * COLUMNS / min(medians) / 1e9


def measure_ggml_gflops(threads: int, seconds: float = 0.3, timeout: float = 30.0) -> float | None:
    """llama.cpp's Q8_0 multiply rate for ``threads`` threads (one thread's rate times the threads, as the plan's
    GEMM rate is measured), or None when llama-cpp-python's libraries are missing or the measurement failed."""
    library_dir = ggml_library_dir()
    if library_dir is None:
        return None
    code = (
        "import sys; from quantforge.backends.llamacpp.rate import _measure_in_this_process as m; "
        f"print(m(sys.argv[1], {seconds}))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(library_dir)], capture_output=True, text=True, timeout=timeout
        )
        rate = float(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0.0
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    return rate * max(1, threads) if rate > 0 else None
