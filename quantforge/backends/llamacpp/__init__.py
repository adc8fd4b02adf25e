"""GGUF formats through llama.cpp's own converter and quantizer, at the llama.cpp version llama-cpp-python runs.

The F16 file is a shared intermediate of the run: converted once (``convert.py`` here), quantized into every asked
GGUF type by ``llama_model_quantize``. The package holds all of llama.cpp's code: the backend here, ``convert``
(llama.cpp's converter), ``tools`` (its llama-quantize/llama-imatrix), ``rate`` (ggml's measured multiply rate),
``imatrix`` (the importance-matrix backend) and ``auto`` (gguf-auto's search).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import numpy as np

from ...errors import QuantforgeError
from ...logs import capture_output
from ...openmp import wait_briefly
from .. import Backend, Deployment, Format, Intermediate, LogitsRunner, QuantizeJob

GGUF_RUNTIMES = ("llama.cpp", "ollama")

# format name -> (llama.cpp file type name, LLAMA_FTYPE value): the ladder GGUF publishers ship.
FILE_TYPES = {
    "gguf-f16": ("F16", 1),
    "gguf-q8_0": ("Q8_0", 7),
    "gguf-q6k": ("Q6_K", 18),
    "gguf-q5km": ("Q5_K_M", 17),
    "gguf-q4km": ("Q4_K_M", 15),
    "gguf-q4_0": ("Q4_0", 2),
    "gguf-iq4xs": ("IQ4_XS", 30),
    "gguf-q3km": ("Q3_K_M", 12),
    "gguf-iq3m": ("IQ3_M", 27),
    "gguf-iq3xxs": ("IQ3_XXS", 23),
    "gguf-q2k": ("Q2_K", 10),
    "gguf-iq2m": ("IQ2_M", 29),
    "gguf-iq2xs": ("IQ2_XS", 20),
    "gguf-iq2xxs": ("IQ2_XXS", 19),
}
# For disk estimates before a file exists (llama.cpp's own table of bits per weight for a 7B model).
NOMINAL_BITS = {
    "gguf-f16": 16.0,
    "gguf-q8_0": 8.5,
    "gguf-q6k": 6.56,
    "gguf-q5km": 5.7,
    "gguf-q4km": 4.9,
    "gguf-q4_0": 4.5,
    "gguf-iq4xs": 4.25,
    "gguf-q3km": 3.9,
    "gguf-iq3m": 3.7,
    "gguf-iq3xxs": 3.1,
    "gguf-q2k": 3.0,
    "gguf-iq2m": 2.7,
    "gguf-iq2xs": 2.3,
    "gguf-iq2xxs": 2.1,
}
# The IQ2/IQ3 types llama.cpp makes only with an importance matrix (llama-quantize refuses IQ2 without one; the IQ3
# ones lose too much without): the imatrix backend makes them, from the run's calibration set.
NEEDS_IMATRIX = ("gguf-iq3m", "gguf-iq3xxs", "gguf-iq2m", "gguf-iq2xs", "gguf-iq2xxs")
PLAIN_TYPES = tuple(name for name in FILE_TYPES if name not in NEEDS_IMATRIX)


def _gguf_format(name: str) -> Format:
    scheme = FILE_TYPES[name][0]
    return Format(name, "gguf", scheme, GGUF_RUNTIMES, NOMINAL_BITS[name], f"GGUF {scheme} (llama.cpp, Ollama)", "GGUF")


def gguf_file_in(folder: Path) -> Path:
    files = sorted(folder.glob("*.gguf"))
    if len(files) != 1:
        raise QuantforgeError(f"{folder} should hold exactly one .gguf file, found {len(files)}")
    return files[0]


def tensor_types(gguf_path: Path) -> dict[str, str]:
    from ...artifacts import gguf_tensors

    return {tensor.name: tensor.tensor_type.name for tensor in gguf_tensors(gguf_path)}


def quantize_gguf(source: Path, target: Path, ftype: int, threads: int, log_path: Path) -> dict:
    """Run llama.cpp's quantizer; return how many tensors fell back to another type."""
    wait_briefly()  # before llama.cpp's library starts its threads (openmp.py)
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    with capture_output(log_path):
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise QuantforgeError(f"llama.cpp's quantizer failed (status {status}); see {log_path}")
    return {"fallback_tensors": fallback_tensors(log_path.read_text(errors="replace"))}


def fallback_tensors(quantizer_output: str) -> int:
    """How many tensors llama.cpp's quantizer gave another type (a width not a multiple of the block size)."""
    fallback = re.findall(r"(\d+) of (\d+) tensor\(s\) required fallback", quantizer_output)
    return int(fallback[-1][0]) if fallback else 0


LOGIT_ROWS = 256  # positions decoded at a time by the evaluation (see docs/design.md for why 256)

# llama.cpp's quantized KV-cache types (llama-server's -ctk/-ctv) and their bytes per cached value: a block of 32
# values is 32 one-byte (q8_0) or 16 packed 4-bit (q4_0) quants and one 16-bit scale. llama.cpp quantizes the V
# cache only with flash attention on.
KV_CACHE_BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32}


class LlamaCppRunner:
    runtime = "llama.cpp"

    def __init__(
        self, gguf_path: Path, *, context: int, threads: int, device: str = "cpu", kv_cache: str | None = None
    ):
        wait_briefly()
        import llama_cpp
        from llama_cpp import Llama

        from ...device import llama_gpu_params

        # Every layer on the chosen GPU when one was chosen and this llama.cpp build can offload (a CUDA build).
        gpu = llama_gpu_params(device, llama_cpp.llama_supports_gpu_offload())
        if gpu["n_gpu_layers"]:
            self.runtime = "llama.cpp (CUDA)"

        # Off by default: it matches the float reference, and it is llama-cpp-python's default. A quantized V cache
        # needs it (llama.cpp refuses one without), so a quantized KV cache is measured with it on.
        self.flash_attn = kv_cache is not None
        self.kv_cache = kv_cache or "f16"
        cache = {}
        if kv_cache is not None:
            if kv_cache not in KV_CACHE_BYTES:
                raise QuantforgeError(
                    f"unknown KV-cache type {kv_cache!r}: llama.cpp's are {', '.join(KV_CACHE_BYTES)}"
                )
            ggml_type = getattr(llama_cpp, f"GGML_TYPE_{kv_cache.upper()}")
            cache = {"type_k": ggml_type, "type_v": ggml_type}
        self.threads = threads
        self.llm = Llama(
            str(gguf_path),
            n_ctx=context,
            # A window is decoded LOGIT_ROWS positions at a time, through the KV cache: llama.cpp's output buffer
            # and its compute buffer then hold that many positions' logits, not the window's (a 150k vocabulary at
            # 2048 tokens: 1.2 GB each). On CPU the logits are bit for bit those of one whole-window decode.
            n_batch=min(context, LOGIT_ROWS),
            n_ubatch=min(context, LOGIT_ROWS),
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            flash_attn=self.flash_attn,
            verbose=False,
            **cache,
            **gpu,
        )

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Every position's logits for the window, a copy the caller keeps."""
        ids = [int(t) for t in tokens]
        out = np.empty((len(ids), self.llm.n_vocab()), dtype=np.float32)
        for start, rows in self._decode(ids, len(ids)):
            out[start : start + len(rows)] = rows
        return out

    def scored_logits(self, tokens: np.ndarray, first: int = 0):
        """The logits of the scored positions (``first`` to the last but one), a block of positions at a time, read
        in place from llama.cpp's buffer: each block is valid until the next is asked for. (Llama.eval would copy
        them into its own score matrix too.) The output layer runs on those positions alone, as in
        llama-perplexity."""
        ids = [int(t) for t in tokens]
        return (rows for _, rows in self._decode(ids, len(ids) - 1, first=first))

    def last_logits(self, tokens: np.ndarray, rows: int) -> np.ndarray:
        """The logits of the window's last ``rows`` positions (a task's continuation), a copy the caller keeps.
        llama.cpp computes its output layer for those positions alone (and for each block's last, which it always
        does), not for the whole window."""
        ids = [int(t) for t in tokens]
        return np.concatenate([block.copy() for _, block in self._decode(ids, len(ids), first=len(ids) - rows)])

    def _decode(self, ids: list[int], wanted: int, first: int = 0):
        """(first position, logits rows) for positions [first, wanted), decoding ``ids`` from an empty cache; a
        block's positions before ``first`` get no output (but its last, which llama.cpp always computes)."""
        context, batch, vocab = self.llm._ctx, self.llm._batch, self.llm.n_vocab()
        context.kv_cache_clear()
        step = self.llm.n_batch
        for start in range(0, len(ids), step):
            if start >= wanted:
                return  # the rest would only extend the cache
            block = ids[start : start + step]
            skipped = min(max(0, first - start), len(block))  # leading positions without output
            batch.set_batch(batch=block, n_past=start, logits_all=skipped == 0)
            for i in range(skipped, len(block)):
                batch.batch.logits[i] = True
            context.decode(batch)
            outputs = max(1, len(block) - skipped)
            rows = np.ctypeslib.as_array(context.get_logits(), shape=(outputs * vocab,)).reshape(outputs, vocab)
            if skipped < len(block):
                yield start + skipped, rows[: wanted - start - skipped]

    def close(self) -> None:
        from ...memory import release_freed_memory

        if self.llm is not None:
            self.llm.close()
            self.llm = None
        release_freed_memory()


def convert_f16(job: QuantizeJob) -> dict:
    """The F16 GGUF every llama.cpp format is quantized from, by llama.cpp's own converter."""
    from .convert import convert_hf_to_gguf

    source, log_path = job.source, job.log_dir / "convert-gguf.log"
    return convert_hf_to_gguf(source.path, job.out, outtype="f16", name=source.name, log_path=log_path)


F16_GGUF = Intermediate(".gguf", convert_f16)


class LlamaCppBackend(Backend):
    name = "llamacpp"
    formats = {name: _gguf_format(name) for name in PLAIN_TYPES}
    refuses = {
        name: "llama.cpp makes it only with an importance matrix: leave --backend out (the imatrix backend makes "
        "it from the calibration set) or ask --backend imatrix"
        for name in NEEDS_IMATRIX
    }
    requires = ("llama_cpp", "gguf")
    extra = "gguf"
    runtime_module = "llama_cpp"
    quantizes_in_transformers = False  # llama.cpp's quantizer reads the F16 GGUF

    def check(self, source, fmt: Format, settings: dict) -> list[str]:
        from .convert import find_converter

        find_converter()  # not installed: a one-line error saying how to install it, before any work
        tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")
        if not any((source.path / name).exists() for name in tokenizer_files):
            return [f"{source.path} has no tokenizer files ({', '.join(tokenizer_files)}), which GGUF conversion needs"]
        return []

    def unsupported(self, source, fmt: Format) -> str | None:
        from .convert import architecture_problem

        return architecture_problem(source.config.get("architecture"))

    def intermediates(self, fmt: Format) -> dict:
        return {"gguf-f16": F16_GGUF}

    def quantize(self, job: QuantizeJob) -> dict:
        from .convert import describe

        f16 = job.intermediate("gguf-f16")
        scheme, ftype = FILE_TYPES[job.format.name]
        job.out.mkdir(parents=True)
        target = job.out / f"{job.source.name}-{scheme}.gguf"
        facts: dict = {"converter": describe(), "quantizer": "llama.cpp llama_model_quantize"}
        if job.format.name == "gguf-f16":
            try:
                os.link(f16, target)  # the intermediate is already this artifact; a hard link costs no space
            except OSError:
                import shutil

                shutil.copyfile(f16, target)
        else:
            facts.update(quantize_gguf(f16, target, ftype, job.threads, job.log_dir / f"{job.format.name}.log"))
        facts["tensor_types"] = dict(Counter(tensor_types(target).values()))
        return facts

    def artifact_file(self, artifact_dir: Path) -> Path:
        return gguf_file_in(artifact_dir)

    def kv_cache_types(self, fmt: Format) -> dict[str, float]:
        return dict(KV_CACHE_BYTES)

    def open_runner(
        self, artifact_dir: Path, *, context: int, threads: int, device: str = "cpu", kv_cache: str | None = None
    ) -> LogitsRunner:
        from ...artifacts import gguf_tensors

        gguf = self.artifact_file(artifact_dir)
        gguf_tensors(gguf)  # a damaged file gets a clear error, not a crash in C
        return LlamaCppRunner(gguf, context=context, threads=threads, device=device, kv_cache=kv_cache)

    def probe_target(self, artifact_dir: Path) -> tuple[str, Path]:
        return "llama.cpp", self.artifact_file(artifact_dir)

    def deployment(self, folder: Path, card: dict, entry: dict, chat: tuple[str | None, dict]) -> Deployment:
        """The llama.cpp commands and an Ollama Modelfile (with a TEMPLATE when the chat template converts)."""
        from ...deploy import (
            chat_template_to_ollama,
            llama_cli_command,
            llama_server_command,
            modelfile,
            ollama_command,
            serving,
        )
        from ...fsutil import atomic_write_text

        template, special = chat
        fit = next(iter(entry.get("memory_fit", {}).values()), None) if card["targets"].get("gpu") else None
        context, kv_cache = serving(fit, card["targets"]["context"])
        gguf = sorted(folder.glob("*.gguf"))[0]
        go_template, stops, note = None, [special["eos_token"]] if special.get("eos_token") else [], None
        if template:
            try:
                go_template, stops = chat_template_to_ollama(
                    template, {**special, "runtime_adds_bos": gguf_adds_bos(gguf)}
                )
            except QuantforgeError as exc:
                note = f"The Modelfile has no TEMPLATE ({exc}); Ollama then uses the chat template stored in the GGUF."
        else:
            note = "The source has no chat template: the Modelfile has no TEMPLATE."
        atomic_write_text(folder / "Modelfile", modelfile(gguf.name, go_template, stops, context))
        usage = [
            "```bash",
            llama_server_command(gguf.name, context, kv_cache),
            llama_cli_command(gguf.name, context, kv_cache),
            ollama_command(f"{card['model']['name']}-{entry['format']}"),
            "```",
        ]
        usage += _kv_cache_notes(entry, fit, kv_cache)
        return Deployment("gguf", ["gguf"], {}, usage + (["", note] if note else []))


def _kv_cache_notes(entry: dict, fit: dict | None, chosen: str | None) -> list[str]:
    """What the server command's KV cache is and what it costs, or what a measured quantized one would cost."""
    measured = entry.get("kv_cache") or {}

    def cost(kv: str) -> str:
        figures = measured.get(kv)
        if not figures or "kld_ratio" not in figures:
            return "its cost in KL was not measured (build with --kv-cache " + kv + ")"
        return f"mean KL {figures['kld_ratio']:.2f}x the 16-bit cache's on the card's windows"

    if chosen:
        held = f"{fit['context']} tokens x {fit['concurrency']} sequence(s)"
        line = f"A 16-bit KV cache of {held} does not fit on {fit['gpu']}; a {chosen} one does: "
        return ["", line + cost(chosen) + "."]
    lines = []
    for kv, figures in measured.items():
        flags = f"`-fa on -ctk {kv} -ctv {kv}`"
        size = f"{figures['bytes_per_value']:.3g} bytes per cached value instead of 2"
        lines += ["", f"With a {kv} KV cache ({flags}, {size}): {cost(kv)}."]
    return lines


def gguf_adds_bos(path: Path) -> bool:
    """Whether llama.cpp adds BOS itself when it tokenizes a prompt for this GGUF."""
    from ...artifacts import gguf_metadata_value

    return bool(gguf_metadata_value(path, "tokenizer.ggml.add_bos_token"))
