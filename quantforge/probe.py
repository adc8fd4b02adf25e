"""Decode-speed probe and memory-bandwidth roofline.

The probe runs one artifact in its own runtime in a fresh process (so peak memory is the model's, not the
pipeline's): a warm-up, then several runs of a fixed prompt and a fixed number of greedy tokens, reporting the
median of each figure:

- prompt_tps: prompt tokens / time to process the prompt
- ttft_s: time to first token (prompt processing plus the first sampled token)
- decode_tps, tpot_s: tokens per second after the first one, and its inverse (time per output token)
- peak_rss_mb: the probe process's peak resident memory

The host's memory bandwidth for the roofline (see gpus.py) is measured here too: a large memory copy. GPU bounds come
from a table of published figures and are marked as computed, not measured.

On a build with a CUDA device every runtime runs there (``--device``), so that formats are timed on the same
footing: llama.cpp with every layer offloaded (a CUDA build), transformers with the model on the GPU, vLLM on that
GPU alone. The result says where it ran (``device``).

The probe's process is ``quantforge.probe_process`` (it loads a backend for one that brings its own probe, so this
module, which the backends import, imports none of them):

    python -m quantforge.probe_process --runtime llama.cpp --path model.gguf --prompt model-prompt.npy
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from pathlib import Path

import numpy as np


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports (sysfs), or None elsewhere."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def bandwidth_buffer_bytes() -> int:
    """Per array: four times the last-level cache so the copy streams from memory (an EPYC with 3D V-Cache holds
    over 1 GB), at least 256 MB and at most 1 GB."""
    cache = last_level_cache_bytes() or 0
    return min(max(4 * cache, 256 << 20), 1 << 30)


def measure_bandwidth(threads: int = 1, repeats: int = 5, buffer_bytes: int | None = None) -> float:
    """Host memory bandwidth in GB/s: the best of several copies of a buffer larger than the caches, split over
    ``threads`` threads as decoding uses every thread (numpy releases the GIL while it copies); bytes read +
    bytes written."""
    from concurrent.futures import ThreadPoolExecutor

    source = np.ones((buffer_bytes or bandwidth_buffer_bytes()) // 8, dtype=np.float64)
    target = np.empty_like(source)
    parts = [slice(i * len(source) // threads, (i + 1) * len(source) // threads) for i in range(threads)]
    best = float("inf")
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for _ in range(repeats):
            started = time.perf_counter()
            list(pool.map(lambda part: np.copyto(target[part], source[part]), parts))
            best = min(best, time.perf_counter() - started)
    return 2 * source.nbytes / best / 1e9


def _median_report(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _timings(prompt_seconds: float, first_token_at: float, token_times: list[float], prompt_tokens: int) -> dict:
    decode_seconds = token_times[-1] - token_times[0]
    decode_tokens = len(token_times) - 1
    return {
        "prompt_tps": prompt_tokens / prompt_seconds,
        "ttft_s": first_token_at,
        "decode_tps": decode_tokens / decode_seconds if decode_seconds > 0 else float("nan"),
        "tpot_s": decode_seconds / decode_tokens if decode_tokens else float("nan"),
    }


def probe_llama_cpp(
    path: Path, prompt: list[int], gen_tokens: int, threads: int, runs: int, device: str = "cpu"
) -> dict:
    """llama.cpp as its users run it: with the OpenMP wait policy this process was given (see openmp.py)."""
    import llama_cpp
    from llama_cpp import Llama

    from .device import llama_gpu_params

    gpu = llama_gpu_params(device, llama_cpp.llama_supports_gpu_offload())
    llm = Llama(
        str(path),
        n_ctx=len(prompt) + gen_tokens + 8,
        n_batch=len(prompt),
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=False,
        verbose=False,
        **gpu,
    )

    context, batch, vocab = llm._ctx, llm._batch, llm.n_vocab()

    def next_token() -> int:  # greedy, straight from llama.cpp's logits buffer
        return int(np.ctypeslib.as_array(context.get_logits_ith(-1), shape=(vocab,)).argmax())

    def once() -> dict:
        context.kv_cache_clear()
        started = time.perf_counter()
        batch.set_batch(batch=prompt, n_past=0, logits_all=False)
        context.decode(batch)
        prompt_seconds = time.perf_counter() - started
        token_times, position = [], len(prompt)
        for _ in range(gen_tokens):
            token = next_token()
            token_times.append(time.perf_counter() - started)
            batch.set_batch(batch=[token], n_past=position, logits_all=False)
            context.decode(batch)
            position += 1
        return _timings(prompt_seconds, token_times[0], token_times, len(prompt))

    once()  # warm-up
    result = _median_report([once() for _ in range(runs)])
    llm.close()
    result["device"] = device if gpu["n_gpu_layers"] else "cpu"
    return result


def probe_transformers(
    path: Path, prompt: list[int], gen_tokens: int, threads: int, runs: int, device: str = "cpu"
) -> dict:
    """transformers' own loading of the folder: float weights, or the quantization library's kernels for the
    device (its CPU ones on a CPU)."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, threads)))
    import torch

    from .memory import import_transformers_slim

    import_transformers_slim()  # the probe's peak memory is the model's, not unused libraries'
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, device_map=device).eval()
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    # A GPU computes after the call returns: a time is read only once the work queued before it is done.
    done = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def now() -> float:
        done()
        return time.perf_counter()

    def once() -> dict:
        with torch.inference_mode():
            started = now()
            out = model(input_ids=ids, use_cache=True)
            prompt_seconds = now() - started
            past, token_times = out.past_key_values, []
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token_times.append(now() - started)
            for _ in range(gen_tokens - 1):
                out = model(input_ids=token, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                token_times.append(now() - started)
        return _timings(prompt_seconds, token_times[0], token_times, len(prompt))

    once()
    result = _median_report([once() for _ in range(runs)])
    result["kernel"] = type(_first_linear(model)).__module__ + "." + type(_first_linear(model)).__name__
    result["device"] = device
    return result


def _first_linear(model):
    """The first projection of the first decoder layer, whatever it is named (q_proj; Phi-3's fused qkv_proj; a
    quantization library's own module class)."""
    import torch

    layer = model.model.layers[0]
    for module in layer.modules():
        if module is not layer and (isinstance(module, torch.nn.Linear) or hasattr(module, "qweight")):
            return module
    return layer


def probe_vllm(path: Path, prompt: list[int], gen_tokens: int, threads: int, runs: int, device: str = "cuda:0") -> dict:
    """vLLM's own loading of the folder (it picks the Marlin/compressed-tensors kernels itself), greedy, one
    sequence: time to first token from a one-token generation, decode speed from the rest of a full one. vLLM
    takes the first GPU it sees, so the probe sees only ``device``'s (CUDA is not started in this process yet)."""
    from .device import visible_devices_for

    visible = visible_devices_for(device if device.startswith("cuda") else "cuda:0", dict(os.environ))
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Prefix caching is on by default in vLLM: the warm-up and the first call would leave the prompt's KV cached, and
    # every later "time to first token" would time a cache hit. Off, each call prefills the prompt, as the other
    # runtimes' probes do after clearing their KV cache.
    llm = LLM(
        model=str(path),
        max_model_len=len(prompt) + gen_tokens + 8,
        enforce_eager=False,
        seed=0,
        enable_prefix_caching=False,
    )
    request = TokensPrompt(prompt_token_ids=prompt)

    def generate(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([request], params, use_tqdm=False)
        return time.perf_counter() - started

    def once() -> dict:
        first = generate(1)
        total = generate(gen_tokens)
        decode_seconds = max(total - first, 1e-9)
        return {
            "prompt_tps": len(prompt) / first,
            "ttft_s": first,
            "decode_tps": (gen_tokens - 1) / decode_seconds,
            "tpot_s": decode_seconds / (gen_tokens - 1),
        }

    once()  # warm-up: CUDA graphs, kernel selection
    result = _median_report([once() for _ in range(runs)])
    result["device"] = device if device.startswith("cuda") else "cuda:0"
    return result


PROBES = {"llama.cpp": probe_llama_cpp, "transformers": probe_transformers, "vllm": probe_vllm}


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started its program, in MB.

    Linux carries ru_maxrss across fork and exec, so a probe started from a large pipeline process reported the
    pipeline's peak (measured: 1413 MB for every format of a SmolLM2 run); VmHWM belongs to the memory map that
    exec created, so it is the probe's own.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
