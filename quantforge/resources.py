"""A resource plan before any work: each stage's peak memory, disk and time, predicted from the model's size, the
formats asked for and this host's measured speed; and a refusal with the numbers when the host cannot do it.

Memory is predicted from what each stage holds (see ``lean``: a checkpoint in its stored dtype plus one module
widened, the logits of one window, llama.cpp's mapped file), plus the libraries' own footprint. Time is predicted
as work (multiply-adds, bytes) over this host's measured rate of the engine that does it (numpy's float32 GEMM for
torch's stages, ggml's Q8_0 multiply for llama.cpp's evaluation; see ggml_rate.py), times a per-stage factor fitted
on this project's test host by ``scripts/bench_scale.py`` (see docs/design.md), so a faster host gets shorter
predictions. Every stage's actual peak and seconds go into the manifest beside the prediction.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import QuantforgeError
from .rundir import (
    CALIBRATION,
    HOST,
    REFERENCE,
    evaluate_stage,
    intermediate_stage,
    kv_cache_stage,
    quantize_stage,
    speed_stage,
    tasks_stage,
)

DISK_MARGIN = 1.10  # headroom for temporary names, logs and the card
GB = 1e9

# Resident memory of a build process before any model: the libraries, plus its tokenizer (about 1 kB a token).
# Measured as the `tokens` stage's peak: 0.53 GB with SmolLM2's 49k vocabulary, 0.63 GB with Qwen's 152k (0.60 and
# 0.70 while transformers imported scikit-learn, see memory.import_transformers_slim).
LIBRARIES_RSS = 0.48 * GB
# The fetch stage runs before transformers is imported: 0.36 GB at both sizes.
FETCH_RSS = 0.36 * GB
TOKENIZER_BYTES_PER_TOKEN = 1000
# llama.cpp's converter child: its libraries (torch, transformers for the vocabulary) and the tensor it is writing,
# widened (bf16 read, float32, F16 out): its peak follows the largest tensor, not the checkpoint. Measured here:
# a 30 MB tiny llama 0.65 GB, SmolLM2-135M 0.75 GB, the 0.5B qwen2 1.43 GB, and two-layer models at real widths
# (tests/real_shapes.py): Qwen2.5-0.5B's 1.40 GB (a 0.33 GB checkpoint), Mistral-7B's 1.30 GB (1.41 GB) and
# Qwen2.5-7B's 3.82 GB (3.11 GB). The fit gives 0.96-1.08x of all six; the earlier one, 0.6 GB + 0.66 of the
# checkpoint, gave 0.69x at the 7B shape, whose 545M-element tables it did not see.
CONVERTER_RSS = 0.60 * GB
CONVERTER_BYTES_PER_LARGEST_ELEMENT = 6.0
# llama.cpp's quantizer reads a tensor, widens it to float32 and writes its quantized copy, one tensor at a time:
# 0.1 GB + 6.8 bytes an element of the largest tensor (measured on the same three two-layer shapes: 1.02, 0.94-0.97
# and 3.71-3.84 GB at Q4_K_M and Q8_0; within 1.05x of each).
GGUF_QUANTIZE_BYTES_PER_LARGEST_ELEMENT = 6.8

# Seconds per unit of work in units of this host's measured float32 GEMM time (2 x parameters x tokens
# multiply-adds at that rate), or for "evaluate/gguf" of ggml's measured Q8_0 multiply time. Fitted by
# scripts/bench_scale.py on SmolLM2-135M and Qwen2.5-Coder-0.5B (2 cores): "reference" and "evaluate/gguf"; the
# torch-quantizer and dequantized-evaluation factors are estimates, not fitted (docs/design.md).
TIME_FACTORS = {
    "reference": 1.8,  # transformers, float32 arithmetic over bf16 weights
    # llama.cpp, every position's logits (the comparison with the reference is under a tenth of the stage); Q8_0
    # and Q4_K_M files both (Q4_K_M 10-20% slower): the geometric mean of two bench_scale runs on one host, whose
    # eight evaluations took 0.74-1.38 of the predicted time with this factor
    "evaluate/gguf": 0.95,
    # the same against numpy's rate, when ggml's cannot be measured: fitted on an earlier host whose numpy ran
    # about 180 GFLOP/s a thread; on an AVX2-only host (88) it predicted 1.4-1.9x too long
    "evaluate/gguf-by-gemm": 2.6,
    "evaluate/torch": 2.5,  # dequantized per module, every window (estimate)
    # NVFP4 W4A4: its FP4 activations simulated per 16 values in every Linear (dequant.nvfp4_activations). SmolLM2's
    # evaluation took 1.7x its weight-only file's (131 s against 76 s, both beside the test suite), which the plan
    # gave 44 s each at the factor above.
    "evaluate/torch-nvfp4": 4.3,
    "tasks": 1.8,
    # mlx on a Linux CPU, float32 (mlxlm.MLXRunner): its wheel's reference BLAS runs about 2 GFLOP/s against torch's
    # 180 here; the tiny llama 96 and SmolLM2-135M 70-100 times the GEMM time (a Mac's GPU is not priced)
    "evaluate/mlx": 90.0,
    # mlx-lm's generation loop on a Linux CPU in the folder's bf16, the probe's timed tokens: SmolLM2-135M's probes
    # took 193-199 s (32 + 16 tokens, 3 runs and a warm-up; the llama.cpp files' take 1-2 s)
    "speed/mlx": 700.0,
}
FIXED_SECONDS = {  # start-up work that does not grow with the model: imports, child processes, tokenizers
    "fetch": 0.5,
    "tokens": 1.0,
    "calibration": 3.0,
    "host": 3.0,
    "reference": 4.0,
    "evaluate": 1.0,
    "intermediate/gguf-f16": 4.5,
    "intermediate/imatrix": 1.0,
    "quantize/gguf": 0.2,
    "speed": 8.0,
    "card": 2.0,
}
# The torch quantizers (GPTQModel's GPTQ and AWQ, llm-compressor's INT8), fitted with each backend's quantize()
# on the tiny llama and SmolLM2-135M at two calibration sizes each, GPTQ on the 0.5B qwen2 too (docs/design.md):
# seconds = start-up
#   + a solve factor x the decoder layers' weights / this host's float32 GEMM rate (the per-layer solves walk every
#     weight column by column: measured in proportion to the weights, not to the layers)
#   + a token factor x calibration tokens x one token through the decoder layers at that rate (the embeddings and
#     LM head take no part), times BF16_EMULATED_SLOWDOWN for a bf16 calibration on a CPU without bf16 instructions.
# The FP4 formats' rounding is FP8's (the same QuantizationModifier, a scale per group instead of per row): their
# start-up and solve factors are FP8's, not fitted on their own. NVFP4's calibration (its activations' global
# scales, observed layer by layer in llm-compressor's sequential pipeline) takes INT8's token factor: on SmolLM2-135M
# with 16 x 256 calibration tokens it took 326 s against 361 s planned (one run, the test suite sharing the cores).
QUANTIZE_START_SECONDS = {"gptq": 3.5, "awq": 10.0, "int8": 3.2, "fp8": 3.2, "fp4": 3.2, "nvfp4": 3.2}
QUANTIZE_SOLVE_FACTORS = {"gptq": 6.3e4, "awq": 5.5e5, "int8": 5.2e4, "fp8": 5.2e3, "fp4": 5.2e3, "nvfp4": 5.2e3}
QUANTIZE_TOKEN_FACTORS = {"gptq": 8.2, "awq": 184.0, "int8": 13.4, "fp8": 0.0, "fp4": 0.0}  # AWQ: 20 scales
QUANTIZE_TOKEN_FACTORS["nvfp4"] = QUANTIZE_TOKEN_FACTORS["int8"]
# A calibration token's time in bf16 over float32 on a CPU without bf16 instructions, where torch emulates bf16
# multiplies (GPTQModel's GPTQ on SmolLM2-135M, 2 threads; see device.quantizer_dtype).
BF16_EMULATED_SLOWDOWN = 4.2
# Resident bytes a weight during quantization, in bf16: the model (AWQ also its scaled copies); in float32 three
# more: the model at 4 bytes and about one of the mapped bf16 checkpoint still resident (measured 5.0-5.1 bytes at
# 135M and 0.5B). Plus what importing the library adds to a process that has imported transformers:
# gptqmodel 0.18 GB (GPTQ and AWQ), llmcompressor 0.12 GB (INT8).
QUANTIZE_BYTES_PER_WEIGHT = {"gptq": 2.0, "awq": 4.5, "int8": 2.0, "fp8": 2.4, "fp4": 2.4, "nvfp4": 2.4}
FLOAT32_EXTRA_BYTES_PER_WEIGHT = 3.0
# GPTQModel quantizing from its disk offload (a bf16 calibration): resident bytes a decoder weight, beside the
# embedding tables in bf16 (GPTQ fitted on SmolLM2-135M and the 0.5B qwen2: 1.26 and 0.87; AWQ on SmolLM2 alone);
# and what its offload folder holds on disk at its largest, a decoder weight (1.06 and 1.23). docs/design.md.
OFFLOAD_DECODER_BYTES_PER_WEIGHT = {"gptq": 1.1, "awq": 2.7}
OFFLOAD_DISK_BYTES_PER_WEIGHT = 1.3
QUANTIZER_LIBRARY = {
    "gptq": ("gptqmodel", 0.18 * GB),
    "awq": ("gptqmodel", 0.18 * GB),
    "int8": ("llmcompressor", 0.12 * GB),
    "fp8": ("llmcompressor", 0.12 * GB),
    "fp4": ("llmcompressor", 0.12 * GB),
    "nvfp4": ("llmcompressor", 0.12 * GB),
}
DATA_FREE_METHODS = frozenset({"fp8", "fp4"})  # rounded to the nearest value: no calibration activations, no Hessians
NO_HESSIAN_METHODS = DATA_FREE_METHODS | {"nvfp4"}  # NVFP4 calibrates its activations' scales, then rounds
# Each format's quantizer runs in a child process (quantize_process) while the build process waits beside it
# holding its libraries and tokenizer: the host holds both. llama.cpp's quantizer child is Python, numpy and
# llama-cpp-python's libraries before the file it maps (measured: 0.15 GB with a 30 MB tiny model's F16 mapped).
GGUF_QUANTIZE_PROCESS_BYTES = 0.10 * GB
# gguf-auto's search child before any model: Python, numpy, torch (the scoring's float64 scratch is torch's) and
# llama-cpp-python. Measured here: 234 MB. It was planned as a quantizer's child (0.10 GB) and measured 1.19x its
# plan on SmolLM2's search, most of it torch.
SEARCH_PROCESS_BYTES = 0.25 * GB
# What a torch quantizer's child spends before its backend's quantize() starts: Python, quantforge and the slim
# transformers import (measured 4.8 s here; QUANTIZE_START_SECONDS, fitted on quantize() alone, has the rest).
TORCH_QUANTIZER_PROCESS_SECONDS = 4.8
# Each artifact is evaluated by its runtime in a child process (runner_process) while the build scores the logits
# it sends: the child's libraries before any model, and the seconds it takes to start. Measured here: llama.cpp's
# (Python, numpy, llama-cpp-python) 41-43 MB and 0.2-0.35 s; transformers' (torch and the slim transformers import)
# 0.44 GB and about 3.2 s with a tiny model.
# mlx's (mlx-lm imports transformers): 0.57 GB and 6.4 s, measured with the tiny llama.
RUNTIME_PROCESS_BYTES = {"llama.cpp": 0.05 * GB, "transformers": 0.44 * GB, "mlx": 0.57 * GB}
RUNTIME_PROCESS_SECONDS = {"llama.cpp": 0.3, "transformers": 3.2, "mlx": 6.4}
# mlx-lm's converter (mlx-4bit, mlx-8bit) in its child: start-up and seconds per GB of checkpoint (the tiny llama
# and SmolLM2-135M: 7-9 s each, start-up dominating), and its resident bytes per checkpoint byte beside the folder
# it writes (it maps the checkpoint and quantizes lazily, shard by shard: SmolLM2 0.13-0.17, taken as 0.3). Only
# measured up to 270 MB checkpoints.
MLX_CONVERT_SECONDS = 8.0
MLX_CONVERT_SECONDS_PER_GB = 10.0
MLX_CONVERT_BYTES_PER_STORED_BYTE = 0.3
# GPU memory that no allocator counts. Every process that computes on a GPU holds a CUDA context of its own: about
# 0.3-0.43 GB with lazy module loading (CUDA >= 11.7; PyTorch's and other projects' published measurements), plus
# cuBLAS's handles, workspace and the kernels it loads once it multiplies. A child that evaluates or quantizes on
# the GPU holds both; the build process's own context was made when the plan read the device's free memory, so
# it is outside that figure already, and only its kernels are added where it computes (the reference). Published
# figures, not measured here (no GPU); scripts/device_check.py measures torch's on a GPU.
CUDA_PROCESS_BYTES = 0.6 * GB
CUDA_KERNEL_BYTES = 0.15 * GB
# The positions whose logits a task request needs: its answer's (runners' last_logits), a few dozen tokens in the
# bundled tasks' choices; a generation step needs one.
TASK_ANSWER_ROWS = 64
FLOAT32_MEMORY_MARGIN = 1.2  # the plan's memory goal: a float32 calibration is chosen only this far inside memory
CONVERT_SECONDS_PER_GB = 10.8  # llama.cpp's converter: reads the checkpoint, writes F16 (fitted, as above)
GGUF_QUANTIZE_PARAMETERS_PER_SECOND = 43e6  # llama_model_quantize from F16, per thread (fitted, as above)
# K-quants (Q4_K ... Q6_K) search each super-block's scales, about 4x the work of the legacy types, on tensors whose
# rows are a multiple of their 256-value super-block; narrower rows fall back to legacy types (SmolLM2's 576, Qwen
# 0.5B's 896), which is all the fit above saw. Per thread, the stage's seconds (child, quantization, the artifact's
# digest) on the two-layer Qwen2.5-7B shape (82.6 s for Q4_K_M); the full-depth builds, not fitted on:
# Qwen2.5-1.5B 83 s and a 7B-shaped qwen2 342 s, predicted 77 s and 381 s.
KQUANT_PARAMETERS_PER_SECOND = 10e6
# The IQ3/IQ2 types search a lattice for each block: per thread, from the ladder on the tiny llama (13.9M
# parameters, 2 threads: IQ3_XXS 5.9 s, IQ2_XS 4.7 s, IQ2_M 5.9 s, IQ2_XXS 2.5 s; Q4_0 1.0 s). Not measured at a
# real size. IQ4_XS quantizes like a K-quant.
IQ_PARAMETERS_PER_SECOND = 1.2e6
IQ_LATTICE_TYPES = ("iq3m", "iq3xxs", "iq2m", "iq2xs", "iq2xxs")
# llama-imatrix runs the F16 file over the calibration set: at twice the Q8_0 rate the host's llama.cpp reaches
# (F16 weights are twice the bytes; an estimate: its child's peak is not recorded yet, its time is 1.1 s on the
# tiny llama's 8 x 128 tokens).
IMATRIX_F16_SLOWDOWN = 2.0
KQUANT_BLOCK = 256
# The reference's speed probe: transformers on the checkpoint as stored (bf16), prompt and decode alike at about
# this many times the float32 GEMM time of its multiplies where torch emulates bf16 (measured here on the two-layer
# Qwen2.5-7B shape: 128-token prompt at 21.6 GFLOP/s, decode 0.108 s a token, against 152 GFLOP/s float32), 2x
# where the CPU multiplies bf16 itself (an estimate, not measured); plus Python's time per layer per generated token
# (SmolLM2-135M, 30 layers: 38 ms a token, 1.1 ms a layer beyond its multiplies). Predicted within 0.9-1.1x of the
# issue's full-depth 1.5B (142 s) and 7B (571 s) probes, which the old 3 x GEMM time gave as 48 s and 208 s.
REFERENCE_PROBE_SLOWDOWN = {"emulated": 7.0, "native": 2.0}
PROBE_LAYER_SECONDS = 0.0011
# Tensor kinds a gguf-auto search gives a type each, for a dense decoder: q, k, v, o, gate, up, down, the embedding
# and an untied output.
SEARCH_GROUPS = 9
NARROW_WIDTH = 1024  # hidden size below which llama.cpp's evaluation slows in proportion (fitted, as above)


@dataclass(frozen=True)
class ModelSize:
    """What the plan needs of a model: from its config and safetensors headers, or a recipe's ``size``."""

    parameters: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    num_experts: int = 0  # a mixture of experts: experts per layer, and each one's MLP width
    expert_intermediate_size: int = 0
    kv_width: int = 0  # key (or value) values per token per layer: KV heads x head width (0: unknown)

    @property
    def stored_bytes(self) -> int:
        return self.parameters * (4 if self.dtype == "float32" else 2)

    @property
    def bf16_bytes(self) -> int:
        return self.parameters * 2

    @classmethod
    def from_facts(cls, facts: dict) -> "ModelSize":
        missing = [k for k in ("parameters", "hidden_size", "num_layers", "vocab_size") if not facts.get(k)]
        if missing:
            raise QuantforgeError(f"cannot plan resources: the model's size lacks {', '.join(missing)}")
        return cls(
            parameters=int(facts["parameters"]),
            hidden_size=int(facts["hidden_size"]),
            intermediate_size=int(facts.get("intermediate_size") or 4 * facts["hidden_size"]),
            num_layers=int(facts["num_layers"]),
            vocab_size=int(facts["vocab_size"]),
            tie_word_embeddings=bool(facts.get("tie_word_embeddings", False)),
            dtype=str(facts.get("dtype") or "bfloat16"),
            num_experts=int(facts.get("num_experts") or 0),
            expert_intermediate_size=int(facts.get("expert_intermediate_size") or 0),
            kv_width=int(facts.get("num_kv_heads") or 0) * int(facts.get("head_dim") or 0),
        )


@dataclass(frozen=True)
class HostSpeed:
    gemm_gflops: float  # float32 matrix multiply, all threads
    memory_available: int | None
    threads: int
    gpu_memory_free: int | None = None  # of the chosen CUDA device, when one was chosen
    ggml_gflops: float | None = None  # llama.cpp's Q8_0 multiply, all threads (measured when a GGUF is built)
    cpu_bf16: bool | None = None  # whether the CPU has bf16 multiply instructions (device.cpu_multiplies_bf16)
    llamacpp_offload: bool = False  # whether GGUF evaluation runs on the chosen CUDA device (a CUDA llama.cpp)

    def to_json(self) -> dict:
        return asdict(self)


def measure_gemm_gflops(threads: int, size: int = 768, seconds: float = 0.3) -> float:
    """float32 matrix-multiply rate of this host for ``threads`` threads: one thread's rate (numpy's BLAS, median of
    repeated multiplies) times the threads. Measured on one thread because a multi-threaded multiply collapses when
    another process holds a core (measured: 2 threads fell from about 300 to 26 GFLOP/s on a busy 2-core machine,
    one thread from about 180 to 106), while the build's own long stages degrade far less."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    times = []
    with threadpool_limits(limits=1):
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(times) < 3:
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
    return 2 * size**3 / float(np.median(times)) / 1e9 * max(1, threads)


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_memory_free(device: str) -> int | None:
    """Free memory of a CUDA device (torch's view), or None for the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def measure_host(threads: int, device: str = "cpu", llamacpp: bool = False) -> HostSpeed:
    """This host's rates and free memory; llama.cpp's own rate only when the build runs llama.cpp (0.5 s)."""
    from .backends.llamacpp.rate import ggml_offloads_to_cuda, measure_ggml_gflops
    from .device import cpu_multiplies_bf16

    ggml = measure_ggml_gflops(threads) if llamacpp else None
    return HostSpeed(
        round(measure_gemm_gflops(threads), 2),
        available_memory_bytes(),
        threads,
        gpu_memory_free(device),
        round(ggml, 2) if ggml else None,
        cpu_multiplies_bf16(),
        llamacpp and device.startswith("cuda") and ggml_offloads_to_cuda(),
    )


@dataclass
class StagePlan:
    key: str
    seconds: float
    peak_rss_bytes: int
    disk_bytes: int = 0
    vram_bytes: int = 0
    note: str = ""
    child_rss_bytes: int = 0  # of a stage run in a child process beside the build's: the child's own peak
    child_base_bytes: int = 0  # and what of it is the child's libraries (and tokenizer) before any model

    def to_json(self) -> dict:
        return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class PlanInputs:
    """The build's choices the plan depends on (from pipeline.Plan)."""

    formats: list  # (key, cost model, nominal bits): Backend.cost_model, "gguf" (llama.cpp), "mlx" or a torch quantizer
    context: int
    windows: int
    calibration_tokens: int  # samples x seqlen when a format calibrates, else 0
    speed_tokens: int  # (prompt + generated tokens) x timed runs of a probe, 0 when the probe is off
    tasks: list  # lm-eval task names
    device: str = "cpu"
    quantize_dtype: str = "auto"  # the torch quantizers' arithmetic as asked (device.quantizer_dtype resolves it)
    follows_dtype: frozenset = frozenset()  # formats whose backend calibrates in that arithmetic (the rest in bf16)
    first_scored: int = 0  # positions of each window before the first scored one: the output layer skips them
    speed_runs: int = 3  # a probe's timed runs (one warm-up run before them)
    speed_gen_tokens: int = 64  # tokens a probe run generates
    intermediates: frozenset = frozenset()  # the shared files the formats need: "gguf-f16", "imatrix"
    calibration_seqlen: int = 0  # tokens a calibration sequence holds (llama-imatrix's window)
    kv_caches: dict = field(default_factory=dict)  # key -> the quantized KV-cache types its file is measured with


def process_base_bytes(size: ModelSize) -> int:
    """The build process before any model: libraries and the tokenizer."""
    return int(LIBRARIES_RSS + TOKENIZER_BYTES_PER_TOKEN * size.vocab_size)


def _logits_bytes(size: ModelSize, positions: int) -> int:
    return positions * size.vocab_size * 4


def _scoring_bytes(size: ModelSize) -> int:
    """The comparison's scratch: the float64 rows compared at a time (three reused buffers and the top-token search's
    index array)."""
    from .evaluate import ROW_CHUNK

    return ROW_CHUNK * size.vocab_size * 8 * 4


def _activation_bytes(size: ModelSize, context: int) -> int:
    """The widest activations of a window's forward in torch."""
    return context * size.intermediate_size * 4 * 2


def _torch_window_bytes(size: ModelSize, context: int, logit_rows: int) -> int:
    """Scratch for one window scored in torch in the build's process: ``logit_rows`` positions' logits, the
    comparison's rows, the widest activations."""
    return _logits_bytes(size, logit_rows) + _scoring_bytes(size) + _activation_bytes(size, context)


def _llama_window_bytes(size: ModelSize, context: int) -> int:
    """llama.cpp decodes a window a block of positions at a time: that block's logits are in its output buffer and
    again in its compute buffer, and the whole window's keys and values in its 16-bit KV cache (the hidden width
    where the KV heads are unknown: a bound). The cache was left out until it was counted: 12 MB at SmolLM2's 512
    tokens, but Llama-3.1-8B's at 4096 tokens is 0.5 GB."""
    from .backends.llamacpp import LOGIT_ROWS

    kv_cache = 2 * size.num_layers * (size.kv_width or size.hidden_size) * context * 2
    return 2 * _logits_bytes(size, min(context, LOGIT_ROWS)) + kv_cache


# llama.cpp on a CPU copies Q4_K and Q4_0 weights into an interleaved layout for its faster kernels (its "extra
# buffer types", on by default: what its users run), while the mapped file stays resident too. Q4_K_M keeps about
# this share of the decoder's weights in Q4_K (attn_v and ffn_down are partly Q6_K). Measured once, at full depth:
# the Qwen2.5-7B shape's Q4_K_M evaluation held 8.7 GB against 5.7 planned without this term (1.52x); the term adds
# 3.1 GB. The bundled models' and the two-layer shapes' evaluations did not show it (their Q4_K share is small or
# falls back to other types). Other types are not counted: not measured.
REPACKED_Q4_SHARE = 0.85
REPACKED_TYPES = ("q4km", "q4_0")


def _repacked_bytes(size: ModelSize, key: str) -> int:
    """The copy llama.cpp's CPU backend makes of a GGUF file's Q4 decoder weights (K-quantable rows only)."""
    quant = key.split("@")[0].removeprefix("gguf-")
    if quant not in REPACKED_TYPES or size.hidden_size % KQUANT_BLOCK:
        return 0
    return int(REPACKED_Q4_SHARE * decoder_parameters(size) * 4.5 / 8)


# A mixture of experts stored one Linear per expert (as checkpoints are) is converted by transformers 5 on load into
# fused 3-D parameters: the whole model is materialized, with a layer's experts held twice while they are fused.
# Measured on Qwen1.5-MoE-A2.7B's widths at two layers (3.53 GB stored): 1.35x the checkpoint at the load's peak,
# 1.16x after it (the reference had been planned with the untied embedding table mapped, not read: 1.33x over).
MOE_LOAD_PEAK = 1.35
MOE_RESIDENT = 1.16


def _loaded_peak(size: ModelSize) -> int:
    """What loading the checkpoint in transformers holds at its peak (a model kept as stored)."""
    return int(size.stored_bytes * (MOE_LOAD_PEAK if size.num_experts else 1))


def _resident_weights(size: ModelSize) -> int:
    """Stored weights a forward pass touches: an untied embedding table is read only at the looked-up rows."""
    if size.num_experts:
        return int(size.stored_bytes * MOE_RESIDENT)
    if size.tie_word_embeddings:
        return size.stored_bytes
    return size.stored_bytes - size.vocab_size * size.hidden_size * size.stored_bytes // size.parameters


PROBE_PROCESS_BYTES = 100 << 20  # python and numpy in the bandwidth probe's process, before its buffers


def _quantize_held(size: ModelSize, calibration_tokens: int, method: str, dtype: str) -> int:
    """A torch quantizer holds its library, the model's weights, one layer's calibration activations and its
    Hessians."""
    activations = calibration_tokens * size.hidden_size * 4 * 4
    hessians = 4 * size.intermediate_size**2 * 4
    if method in DATA_FREE_METHODS:
        activations = 0
    if method in NO_HESSIAN_METHODS:
        hessians = 0
    return int(QUANTIZER_LIBRARY[method][1] + _quantizer_weight_bytes(size, method, dtype)) + activations + hessians


def _quantizer_weight_bytes(size: ModelSize, method: str, dtype: str) -> int:
    """The whole model (AWQ also its scaled copies); with GPTQModel's disk offload (bf16 calibration), the
    embedding tables and a share of the decoder layers' weights (backends.gptqmodel.disk_offload)."""
    if _offloaded(method, dtype):
        tables = size.parameters - decoder_parameters(size)
        return int(2 * tables + OFFLOAD_DECODER_BYTES_PER_WEIGHT[method] * decoder_parameters(size))
    per_weight = QUANTIZE_BYTES_PER_WEIGHT[method] + (FLOAT32_EXTRA_BYTES_PER_WEIGHT if dtype == "float32" else 0)
    return int(per_weight * size.parameters) + _loaded_peak(size) - size.stored_bytes  # an MoE's fusing on load


def _offloaded(method: str, dtype: str) -> bool:
    """Whether this quantizer runs from GPTQModel's disk offload (backends.gptqmodel.disk_offload)."""
    return method in OFFLOAD_DECODER_BYTES_PER_WEIGHT and dtype != "float32"


def widened_module_bytes(size: ModelSize) -> int:
    """float32 bytes of the largest module widened at once while it runs (``lean``): a slice of a large Linear, or
    a mixture of experts' fused projections, every expert's gate, up and down at once (transformers 5 holds them as
    3-D parameters of one module). Measured: Qwen1.5-MoE-A2.7B's widths (60 experts of 1408) held the reference
    2.06x over a plan that counted one Linear's slice."""
    linear = min(size.hidden_size * size.intermediate_size * 4, 64 << 20)
    experts = size.num_experts * 3 * size.hidden_size * size.expert_intermediate_size * 4
    return max(linear, experts)


def compute_parameters(size: ModelSize) -> int:
    """The weights a token is multiplied by: all but an untied input embedding table, which is only looked up."""
    return size.parameters - (0 if size.tie_word_embeddings else size.vocab_size * size.hidden_size)


def largest_tensor_elements(size: ModelSize) -> int:
    """The largest weight matrix: an embedding table or LM head at real vocabularies, else an MLP projection."""
    return max(size.vocab_size * size.hidden_size, size.hidden_size * size.intermediate_size)


def kquant_parameters(size: ModelSize) -> int:
    """The weights in rows K-quants take whole (a multiple of 256 values): all rows are hidden-wide but the MLP's
    down projection's, which are intermediate-wide; narrower ones fall back to legacy types."""
    down = size.num_layers * size.hidden_size * size.intermediate_size
    hidden_wide = size.parameters - down if size.hidden_size % KQUANT_BLOCK == 0 else 0
    return hidden_wide + (down if size.intermediate_size % KQUANT_BLOCK == 0 else 0)


def _gguf_quantize_seconds(size: ModelSize, key: str, threads: int) -> float:
    """K-quant formats (Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K: a "k" in the quant's name; IQ4_XS) at the K-quant rate
    where rows allow it, the IQ3/IQ2 types at their lattice search's rate."""
    quant = key.split("@")[0].removeprefix("gguf-")
    if quant in IQ_LATTICE_TYPES:
        return kquant_parameters(size) / (IQ_PARAMETERS_PER_SECOND * threads) + (
            size.parameters - kquant_parameters(size)
        ) / (GGUF_QUANTIZE_PARAMETERS_PER_SECOND * threads)
    kquant = kquant_parameters(size) if "k" in quant or quant == "iq4xs" else 0
    return kquant / (KQUANT_PARAMETERS_PER_SECOND * threads) + (size.parameters - kquant) / (
        GGUF_QUANTIZE_PARAMETERS_PER_SECOND * threads
    )


def _reference_probe_seconds(size: ModelSize, inputs: "PlanInputs", flop_seconds: float, emulated: bool) -> float:
    """A warm-up and ``speed_runs`` timed runs, each its prompt and generated tokens, at the stored dtype's rate."""
    runs = inputs.speed_runs
    tokens = inputs.speed_tokens * (runs + 1) / runs
    slowdown = REFERENCE_PROBE_SLOWDOWN["emulated" if emulated else "native"]
    generated = inputs.speed_gen_tokens * (runs + 1)
    return tokens * flop_seconds * slowdown + generated * size.num_layers * PROBE_LAYER_SECONDS


def decoder_parameters(size: ModelSize) -> int:
    """The weights of the decoder layers: what a calibration token passes through (no embeddings, no LM head)."""
    tables = size.vocab_size * size.hidden_size * (1 if size.tie_word_embeddings else 2)
    return max(size.parameters - tables, size.parameters // 10)


def quantize_dtype(size: ModelSize, inputs: PlanInputs, host: HostSpeed) -> tuple[str, str]:
    """The arithmetic of the formats that follow the build's choice: (dtype, why)."""
    from .device import quantizer_dtype

    child = process_base_bytes(size) + _quantize_held(size, inputs.calibration_tokens, "gptq", "float32")
    float32_peak = process_base_bytes(size) + child  # the build process waits beside the quantizer's
    # With room to spare: a float32 choice that runs out of memory costs more than the bf16 one it replaced.
    fits = host.memory_available is None or FLOAT32_MEMORY_MARGIN * float32_peak <= host.memory_available
    return quantizer_dtype(inputs.quantize_dtype, inputs.device, host.cpu_bf16, fits)


def _torch_quantize_seconds(size: ModelSize, method: str, slowdown: float, gemm_gflops: float, tokens: int) -> float:
    weights_seconds = decoder_parameters(size) / (gemm_gflops * 1e9)
    solves = QUANTIZE_SOLVE_FACTORS[method] * weights_seconds
    calibration = QUANTIZE_TOKEN_FACTORS[method] * slowdown * 2 * weights_seconds * tokens
    return QUANTIZE_START_SECONDS[method] + solves + calibration


def plan_stages(size: ModelSize, inputs: PlanInputs, host: HostSpeed, chosen_dtype: str) -> list[StagePlan]:
    """Every stage of the build in run order, with its predicted seconds, peak resident memory and disk; the formats
    in ``inputs.follows_dtype`` calibrate in ``chosen_dtype`` (quantize_dtype)."""
    from .backends.llamacpp import LOGIT_ROWS
    from .runners import HEAD_ROWS

    # one token through the model at GEMM speed (an untied embedding table is looked up, not multiplied)
    flop_seconds = 2 * compute_parameters(size) / (host.gemm_gflops * 1e9)
    ggml_seconds = 2 * compute_parameters(size) / (host.ggml_gflops * 1e9) if host.ggml_gflops else None
    # Tokens through the whole model for the evaluation, in equivalent tokens: the output layer's share of the
    # weights is skipped at the positions a scoring convention leaves out (llama-perplexity's second half).
    head_share = size.vocab_size * size.hidden_size / size.parameters
    eval_tokens = inputs.windows * (inputs.context - inputs.first_scored * head_share)
    base = process_base_bytes(size)
    widened = widened_module_bytes(size)
    on_gpu = inputs.device.startswith("cuda")
    offload = on_gpu and host.llamacpp_offload
    task_rows = min(inputs.context, TASK_ANSWER_ROWS)
    bf16_emulated = not on_gpu and host.cpu_bf16 is False  # torch emulates bf16 multiplies on this CPU
    stages = [
        StagePlan("fetch", FIXED_SECONDS["fetch"], int(FETCH_RSS), size.stored_bytes, note="download not timed"),
        StagePlan("tokens", FIXED_SECONDS["tokens"], base),
    ]

    def torch_stage(key: str, factor: str, tokens: int, held: int, fixed: str) -> StagePlan:
        """The reference's stages, run in the build's process."""
        # Scoring a window holds a block of its logits at a time (TorchRunner.scored_logits); a task, its answer's.
        logit_rows = task_rows if factor == "tasks" else min(inputs.context, HEAD_ROWS)
        rss = base + held + widened + _torch_window_bytes(size, inputs.context, logit_rows)
        seconds = FIXED_SECONDS[fixed] + TIME_FACTORS[factor] * flop_seconds * tokens
        if on_gpu:
            # Weights and activations on the GPU, an untied embedding table whole (a checkpoint is copied there, not
            # mapped); host memory holds the libraries and the logits in hand.
            vram = rss - base - held + size.stored_bytes + int(CUDA_KERNEL_BYTES)
            return StagePlan(key, seconds, base + _logits_bytes(size, logit_rows), 0, vram)
        return StagePlan(key, seconds, rss)

    def runtime_stage(key: str, runtime: str, seconds: float, held: int, logit_rows: int, tasks: bool) -> StagePlan:
        """An artifact's evaluation or task: its runtime in a child holds the model and its scratch (``held``);
        ``logit_rows`` of its logits at a time, at most ``SHARED_ROWS``, cross through memory the build maps too
        and scores (a task's answer's rows are copied first)."""
        from .runner_process import SHARED_ROWS

        logits = _logits_bytes(size, min(logit_rows, SHARED_ROWS))
        beside = base + logits * (2 if tasks else 1) + _scoring_bytes(size)
        child_base = int(RUNTIME_PROCESS_BYTES[runtime])
        if not tasks:  # the tasks follow in the child the evaluation started
            seconds += RUNTIME_PROCESS_SECONDS[runtime]
        if on_gpu and runtime == "transformers":  # the model and its activations on the GPU
            plan = _child_stage(key, seconds, beside, child_base, child_base + logits, 0)
            plan.vram_bytes = held + int(CUDA_PROCESS_BYTES)
            return plan
        plan = _child_stage(key, seconds, beside, child_base, child_base + held, 0)
        if runtime == "llama.cpp" and offload:
            # Every layer and the compute buffer on the GPU. The host's peak still counts the mapped file: llama.cpp
            # reads the weights through it before it lets the offloaded ranges go.
            plan.vram_bytes = held + int(CUDA_PROCESS_BYTES)
        return plan

    def torch_runtime_stage(key: str, factor: str, tokens: int, held: int) -> StagePlan:
        logit_rows = task_rows if factor == "tasks" else min(inputs.context, HEAD_ROWS)
        seconds = FIXED_SECONDS["evaluate"] + TIME_FACTORS[factor] * flop_seconds * tokens
        held += widened + _logits_bytes(size, logit_rows) + _activation_bytes(size, inputs.context)
        return runtime_stage(key, "transformers", seconds, held, logit_rows, factor == "tasks")

    reference_weights = _resident_weights(size)
    stages.append(torch_stage(REFERENCE, "reference", eval_tokens, reference_weights, "reference"))
    for task in inputs.tasks:
        stages.append(torch_stage(tasks_stage(REFERENCE, task), "tasks", 0, reference_weights, "evaluate"))
    if inputs.calibration_tokens:
        stages.append(StagePlan(CALIBRATION, FIXED_SECONDS["calibration"], base))
    from .probe import bandwidth_buffer_bytes

    # the bandwidth probe, a child process, copies one buffer larger than the caches into another
    stages.append(StagePlan(HOST, FIXED_SECONDS["host"], max(base, PROBE_PROCESS_BYTES + 2 * bandwidth_buffer_bytes())))
    if any(costs == "gguf" for _, costs, _ in inputs.formats):
        seconds = FIXED_SECONDS["intermediate/gguf-f16"] + CONVERT_SECONDS_PER_GB * size.stored_bytes / GB
        # The converter is a child process that maps the checkpoint and writes tensor by tensor, holding part of it
        # at its peak; the build process waits beside it.
        child = int(CONVERTER_RSS + CONVERTER_BYTES_PER_LARGEST_ELEMENT * largest_tensor_elements(size))
        stages.append(
            _child_stage(intermediate_stage("gguf-f16"), seconds, base, int(CONVERTER_RSS), child, size.bf16_bytes)
        )
    if "imatrix" in inputs.intermediates:
        # llama.cpp's llama-imatrix, a child process: the F16 file mapped, one calibration sequence's window.
        seconds = FIXED_SECONDS["intermediate/imatrix"] + IMATRIX_F16_SLOWDOWN * inputs.calibration_tokens * (
            ggml_seconds or flop_seconds
        )
        window = _llama_window_bytes(size, inputs.calibration_seqlen or inputs.context)
        child = int(GGUF_QUANTIZE_PROCESS_BYTES + 2 * size.parameters + window)
        stages.append(
            _child_stage(intermediate_stage("imatrix"), seconds, base, int(GGUF_QUANTIZE_PROCESS_BYTES), child, 0)
        )
    bits_of = {key: bits for key, _, bits in inputs.formats}
    for key, costs, bits in inputs.formats:
        artifact = int(size.parameters * bits / 8)
        if costs == "mlx":
            stages += _mlx_stages(key, size, inputs, artifact, base, flop_seconds, runtime_stage)
        elif costs in ("gguf", "gguf-search"):
            quant_key = "gguf-q4km" if costs == "gguf-search" else key  # a search's candidates are K-quant mixes
            quantize_seconds = FIXED_SECONDS["quantize/gguf"] + _gguf_quantize_seconds(
                size, quant_key, max(1, host.threads)
            )
            # llama.cpp reads, widens and quantizes one tensor at a time, in a child process beside the build's.
            child = int(
                GGUF_QUANTIZE_PROCESS_BYTES + GGUF_QUANTIZE_BYTES_PER_LARGEST_ELEMENT * largest_tensor_elements(size)
            )
            # llama.cpp's evaluation runs further below its kernel's rate on narrow layers (measured: SmolLM2's
            # 576-wide ones at about 0.65 of the rate of Qwen's 896-wide ones, relative to the FLOPs), where the
            # per-layer work besides the multiplies weighs more.
            narrow = max(1.0, NARROW_WIDTH / size.hidden_size)
            work = narrow * eval_tokens * (ggml_seconds or flop_seconds)
            factor = TIME_FACTORS["evaluate/gguf" if ggml_seconds else "evaluate/gguf-by-gemm"]
            seconds = FIXED_SECONDS["evaluate"] + factor * work
            repacked = 0 if offload else _repacked_bytes(size, quant_key)
            held = artifact + _llama_window_bytes(size, inputs.context) + repacked
            if costs == "gguf-search":
                # gguf-auto's search (backends/llamacpp/auto.py), in the quantize child: its candidates made by
                # llama-quantize (a process of its own) and scored in the child on a few windows, one confirmed on
                # all of them, the chosen file made. The child holds its libraries throughout (torch too: the
                # scoring's scratch), then either llama-quantize runs beside it or a candidate's runner is in it.
                from .backends.llamacpp import NOMINAL_BITS
                from .backends.llamacpp.auto import LADDER, SENSITIVITY_WINDOWS

                few = min(SENSITIVITY_WINDOWS, inputs.windows) / max(inputs.windows, 1)
                rounds = 1 + (len(LADDER) - 1) * SEARCH_GROUPS
                search = rounds * (quantize_seconds + few * seconds) + quantize_seconds + seconds
                # a candidate raises some groups above Q4_K: sized as if Q6_K throughout (half the weights at Q8_0)
                candidate = int(size.parameters * NOMINAL_BITS["gguf-q6k"] / 8)
                runner = candidate + _llama_window_bytes(size, inputs.context) + repacked + _scoring_bytes(size)
                scored = _logits_bytes(size, min(inputs.context, LOGIT_ROWS))  # a block read out of llama.cpp
                stages.append(
                    _child_stage(
                        quantize_stage(key), search + quantize_seconds, base, int(SEARCH_PROCESS_BYTES),
                        int(SEARCH_PROCESS_BYTES) + max(child, runner + scored), artifact,
                    )
                )  # fmt: skip
            else:
                stages.append(
                    _child_stage(
                        quantize_stage(key), quantize_seconds, base, int(GGUF_QUANTIZE_PROCESS_BYTES), child, artifact
                    )
                )
            rows = min(inputs.context, LOGIT_ROWS)
            stages.append(runtime_stage(evaluate_stage(key), "llama.cpp", seconds, held, rows, tasks=False))
            # the file again with a quantized KV cache: the same work (measured: SmolLM2, q8_0 0.98x the time)
            for kv_cache in inputs.kv_caches.get(key, ()):
                stages.append(runtime_stage(kv_cache_stage(key, kv_cache), "llama.cpp", seconds, held, rows, False))
            for task in inputs.tasks:
                seconds = FIXED_SECONDS["evaluate"]
                stages.append(runtime_stage(tasks_stage(key, task), "llama.cpp", seconds, held, task_rows, True))
        else:
            method = costs
            calibration = max(inputs.calibration_tokens, 1)
            dtype = chosen_dtype if key in inputs.follows_dtype else "bfloat16"
            slowdown = BF16_EMULATED_SLOWDOWN if dtype == "bfloat16" and bf16_emulated else 1.0
            seconds = TORCH_QUANTIZER_PROCESS_SECONDS + _torch_quantize_seconds(
                size, method, slowdown, host.gemm_gflops, calibration
            )
            held = _quantize_held(size, calibration, method, dtype)
            library_bytes = int(QUANTIZER_LIBRARY[method][1])
            # In the child: the libraries, the tokenizer and what the quantizer holds; on a GPU the model is there,
            # and host memory holds the libraries and the loaded checkpoint (what of it is not offloaded to disk).
            loaded = min(_quantizer_weight_bytes(size, method, dtype), size.bf16_bytes)
            child = base + (library_bytes + loaded if on_gpu else held)
            disk = artifact
            if _offloaded(method, dtype):
                disk += int(OFFLOAD_DISK_BYTES_PER_WEIGHT * decoder_parameters(size))  # gone once it is done
            plan = _child_stage(quantize_stage(key), seconds, base, base, child, disk, f"{dtype} arithmetic")
            if on_gpu:
                plan.vram_bytes = held - library_bytes + int(CUDA_PROCESS_BYTES)
            stages.append(plan)
            # Packed weights, plus the unquantized embedding table (and LM head, when untied) in 16 bits.
            unquantized = size.vocab_size * size.hidden_size * 2 * (1 if size.tie_word_embeddings else 2)
            held = artifact + unquantized
            factor = "evaluate/torch-nvfp4" if method == "nvfp4" else "evaluate/torch"
            stages.append(torch_runtime_stage(evaluate_stage(key), factor, eval_tokens, held))
            for task in inputs.tasks:
                stages.append(torch_runtime_stage(tasks_stage(key, task), "tasks", 0, held))
    if inputs.speed_tokens:
        methods = {key: costs for key, costs, _ in inputs.formats}
        for key in [REFERENCE, *bits_of]:
            costs = methods.get(key)
            if key == REFERENCE:
                seconds = FIXED_SECONDS["speed"] + _reference_probe_seconds(size, inputs, flop_seconds, bf16_emulated)
            else:
                factor = TIME_FACTORS["speed/mlx"] if costs == "mlx" else 3
                seconds = FIXED_SECONDS["speed"] + factor * flop_seconds * inputs.speed_tokens
            held = _loaded_peak(size) if key == REFERENCE else int(bits_of[key] * size.parameters / 8)
            if costs == "gguf" and not offload:
                held += _repacked_bytes(size, key)
            # The probe is a child process beside the build's: its runtime's libraries (and a quantization
            # library's, loaded by transformers for its kernels) before the model. Measured once its own peak was
            # recorded: the two-layer SmolLM2 shape's GPTQ probe held 1.92x a plan that counted one process.
            runtime = {"gguf": "llama.cpp", "mlx": "mlx"}.get(costs, "transformers")
            probe_base = RUNTIME_PROCESS_BYTES[runtime]
            if runtime == "transformers" and key != REFERENCE:
                probe_base += QUANTIZER_LIBRARY[costs][1]
            plan = _child_stage(speed_stage(key), seconds, base, int(probe_base), int(probe_base + held), 0)
            if on_gpu and (offload or costs not in ("gguf", "mlx")):  # the probe runs on the build's device (probe.py)
                plan.vram_bytes = held + int(CUDA_PROCESS_BYTES)
            stages.append(plan)
    stages.append(StagePlan("card", FIXED_SECONDS["card"], base))
    return stages


def _mlx_stages(
    key: str, size: ModelSize, inputs: PlanInputs, artifact: int, base: int, flop_seconds: float, runtime_stage
):
    """mlx-lm's converter, then mlx's evaluation, each in a child (on the CPU: mlx runs on no NVIDIA GPU).

    The converter maps the checkpoint, casts and quantizes it lazily and writes the folder. The evaluation holds the
    folder's weights with their scales and offsets widened to float32 (a bit a weight more: 64-weight groups), and
    a window's float32 logits twice (mlx's and the copy handed over). Measured on SmolLM2-135M, 4 windows of 256:
    0.23 GB (4-bit) and 0.30 GB (8-bit) beside the process's own, planned 0.23 and 0.31."""
    seconds = MLX_CONVERT_SECONDS + size.stored_bytes / GB * MLX_CONVERT_SECONDS_PER_GB
    child = int(RUNTIME_PROCESS_BYTES["mlx"] + MLX_CONVERT_BYTES_PER_STORED_BYTE * size.stored_bytes + artifact)
    quantize = _child_stage(quantize_stage(key), seconds, base, int(RUNTIME_PROCESS_BYTES["mlx"]), child, artifact)
    eval_tokens = inputs.windows * inputs.context
    seconds = FIXED_SECONDS["evaluate"] + TIME_FACTORS["evaluate/mlx"] * flop_seconds * eval_tokens
    bits = 8 * artifact / size.parameters
    held = int(artifact * (bits + 1) / bits) + 2 * _logits_bytes(size, inputs.context)
    held += _activation_bytes(size, inputs.context)
    from .backends.mlxlm import LOGIT_BLOCK

    stages = [quantize, runtime_stage(evaluate_stage(key), "mlx", seconds, held, LOGIT_BLOCK, False)]
    for task in inputs.tasks:
        stages.append(
            runtime_stage(tasks_stage(key, task), "mlx", FIXED_SECONDS["evaluate"], held, TASK_ANSWER_ROWS, True)
        )
    return stages


def _child_stage(
    key: str, seconds: float, beside: int, child_base: int, child: int, disk: int, note: str = ""
) -> StagePlan:
    """A stage whose work runs in a child process (``child`` bytes at its peak, ``child_base`` of them before any
    model) while the build process (``beside`` bytes) waits: the host holds both, and that sum is the stage's
    peak; the child's own is kept for comparison with its measured one."""
    note = f"{note}; child process" if note else "child process"
    return StagePlan(key, seconds, beside + child, disk, note=note, child_rss_bytes=child, child_base_bytes=child_base)


def summarize(stages: list[StagePlan], size: ModelSize) -> dict:
    peak = max(stages, key=lambda s: s.peak_rss_bytes)
    vram = max(stages, key=lambda s: s.vram_bytes)
    return {
        "seconds": round(sum(s.seconds for s in stages), 1),
        "peak_rss_bytes": peak.peak_rss_bytes,
        "peak_stage": peak.key,
        "peak_vram_bytes": vram.vram_bytes,
        "disk_bytes": int(sum(s.disk_bytes for s in stages) * DISK_MARGIN),
        "bf16_weights_bytes": size.bf16_bytes,
        "peak_over_bf16": round(peak.peak_rss_bytes / size.bf16_bytes, 3),
        # What the model itself costs: the peak less the footprint before any model of each process then running
        # (a quantizer's child has libraries and a tokenizer of its own).
        "peak_beyond_libraries_over_bf16": round(
            (peak.peak_rss_bytes - process_base_bytes(size) - peak.child_base_bytes) / size.bf16_bytes,
            3,
        ),
    }


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _refuse_largest(stages: list[dict], field: str, limit: int | None, what: str, advice: str) -> None:
    """One line naming the stage that needs most of ``field``, when it needs more than ``limit``."""
    if not stages or not limit or os.environ.get("QUANTFORGE_IGNORE_MEMORY"):
        return
    worst = max(stages, key=lambda s: s[field])
    if worst[field] > limit:
        raise QuantforgeError(
            f"not enough {what}: stage {worst['key']} needs about {worst[field] / GB:.1f} GB and "
            f"{limit / GB:.1f} GB is available; {advice}, or QUANTFORGE_IGNORE_MEMORY=1 to try anyway"
        )


def check_plan(plan: dict, run_dir: Path, done: set[str] = frozenset()) -> None:
    """Refuse, with the numbers, a build this host cannot hold: memory (and GPU memory) of the largest stage, disk
    of all stages not yet done. ``QUANTFORGE_IGNORE_MEMORY=1`` lets a user try anyway."""
    stages = [s for s in plan["stages"] if s["key"] not in done]
    host = plan["host"]
    _refuse_largest(stages, "peak_rss_bytes", host.get("memory_available"), "memory",
                    "use a machine with more memory, fewer formats")  # fmt: skip
    _refuse_largest(stages, "vram_bytes", host.get("gpu_memory_free"), f"GPU memory on {plan['device']}",
                    "use a larger GPU, --device cpu")  # fmt: skip
    needed = int(sum(s["disk_bytes"] for s in stages if s["key"] != "fetch") * DISK_MARGIN)
    free = shutil.disk_usage(_existing_parent(run_dir)).free
    if needed > free:
        raise QuantforgeError(
            f"not enough disk at {run_dir}: the planned artifacts need about {needed / GB:.2f} GB and "
            f"{free / GB:.2f} GB is free; free space or choose another --out"
        )


def make_resource_plan(size: ModelSize, inputs: PlanInputs, host: HostSpeed) -> dict:
    dtype, why = quantize_dtype(size, inputs, host)
    stages = plan_stages(size, inputs, host, dtype)
    return {
        "model": asdict(size),
        "host": host.to_json(),
        "device": inputs.device,
        # the formats that calibrate in it (the others in bf16): the build hands it to their quantizers
        "quantize_dtype": {"dtype": dtype, "why": why, "formats": sorted(inputs.follows_dtype)},
        "stages": [s.to_json() for s in stages],
        "total": summarize(stages, size),
    }


def plan_versus_actual(plan: dict, stages: dict) -> list[dict]:
    """Per stage: predicted and measured seconds and peak memory, and their ratios (from a run's manifest)."""
    rows = []
    for predicted in plan.get("stages", []):
        record = stages.get(predicted["key"])
        if not record:
            continue
        measured = record.get("memory") or {}
        memory, child = measured.get("peak_rss_bytes"), measured.get("child_peak_rss_bytes")
        # Both processes at once where the stage waited for a child it ran (quantize); else the larger of the two.
        actual_memory = measured.get("host_peak_rss_bytes") or max(memory or 0, child or 0) or None
        rows.append(
            {
                "key": predicted["key"],
                "predicted_seconds": predicted["seconds"],
                "seconds": record.get("seconds"),
                "time_ratio": round(record["seconds"] / predicted["seconds"], 2) if record.get("seconds") else None,
                "predicted_peak_rss_bytes": predicted["peak_rss_bytes"],
                "peak_rss_bytes": actual_memory,
                "memory_ratio": round(actual_memory / predicted["peak_rss_bytes"], 2) if actual_memory else None,
            }
        )
        gpu = measured.get("gpu_peak_bytes")
        if gpu is not None:  # sampled on a CUDA device while the stage ran (memory.GpuWatch)
            planned = predicted.get("vram_bytes") or 0
            rows[-1].update(predicted_vram_bytes=planned, vram_bytes=gpu,
                            vram_ratio=round(gpu / planned, 2) if planned else None)  # fmt: skip
    return rows
