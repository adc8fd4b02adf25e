"""GGUF K-quants rounded by auto-round, calibrated on the run's shared calibration set, evaluated in llama.cpp.

At the same file size and the same per-tensor types as llama.cpp's own Q4_K_M/Q5_K_M mix, how each weight is
rounded decides quality; auto-round's GGUF export (``iters=0``: its calibrated rounding without the sign-gradient
tuning) measured less than half of llama.cpp's perplexity loss on SmolLM2-135M Q4_K_M.

auto-round downloads NeelNanda/pile-10k for calibration unless it is given texts: it always gets the run's
calibration sequences, decoded back to text, so it never reaches the Hub.
"""

from __future__ import annotations

import shutil

from . import QuantizeJob
from .hf import load_calibration, set_threads
from .llamacpp import FILE_TYPES, LlamaCppBackend, _gguf_format, tensor_types

SCHEMES = {"gguf-q8_0": "gguf:q8_0", "gguf-q6k": "gguf:q6_k", "gguf-q5km": "gguf:q5_k_m", "gguf-q4km": "gguf:q4_k_m"}
DEFAULT_ITERS = 0


def let_go_of_the_model() -> None:
    """Reset auto-round's process-wide singletons, which keep the model it rounded until the next AutoRound: the
    model context and the GGUF shard writer (measured on SmolLM2-135M: 0.13 GB stayed resident after the stage)."""
    from auto_round.compressors.shard_writer import ShardWriter
    from auto_round.context.compress import CompressContext
    from auto_round.context.model import ModelContext

    ShardWriter.reset()
    ModelContext.reset_context()
    CompressContext.reset_context()


class AutoRoundBackend(LlamaCppBackend):
    name = "autoround"
    formats = {name: _gguf_format(name) for name in SCHEMES}
    requires = ("auto_round", "llama_cpp", "gguf")
    extra = "autoround"
    alternative_for = frozenset(SCHEMES)
    needs_calibration = True
    quantizes_in_transformers = True
    progress_pattern = r"Quantizing model\.layers\.(\d+).*?/(\d+)"

    def check(self, source, fmt, settings: dict) -> list[str]:
        # auto-round writes the GGUF with its own copy of llama.cpp's conversion code: no converter to check for.
        if not (source.path / "tokenizer.json").exists():
            return [f"{source.path} has no tokenizer.json, which auto-round's GGUF export needs"]
        return []

    def unsupported(self, source, fmt) -> str | None:
        return None  # auto-round's own conversion code decides; a failure there fails only this format

    def quantize(self, job: QuantizeJob) -> dict:
        from collections import Counter

        import torch
        from auto_round import AutoRound
        from transformers import AutoModelForCausalLM, AutoTokenizer

        set_threads(job.threads)
        scheme = SCHEMES[job.format.name]
        calibration = load_calibration(job.calibration)
        tokenizer = AutoTokenizer.from_pretrained(job.source.path)
        texts = [tokenizer.decode(row) for row in calibration]
        iters = int(job.settings.get("autoround_iters", DEFAULT_ITERS))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(
            job.source.path, dtype="auto", trust_remote_code=job.source.trust_remote_code
        )
        rounder = AutoRound(
            model,
            tokenizer,
            scheme=scheme,
            iters=iters,
            nsamples=len(texts),
            seqlen=int(calibration.shape[1]),
            dataset=texts,
            seed=0,
            device_map=job.device,
        )
        export = job.out.with_name(job.out.name + "-export")
        try:
            rounder.quantize_and_save(str(export), format=scheme)
            written = sorted(export.rglob("*.gguf"))
            if len(written) != 1:
                raise RuntimeError(f"auto-round wrote {len(written)} GGUF files, expected one")
            job.out.mkdir(parents=True)
            # "-autoround": the plain and importance-matrix files of this type must keep names of their own
            target = job.out / f"{job.source.name}-{FILE_TYPES[job.format.name][0]}-autoround.gguf"
            shutil.move(str(written[0]), target)
        finally:
            shutil.rmtree(export, ignore_errors=True)
            rounder = model = None  # a failure's traceback keeps this frame alive while it is recorded
            let_go_of_the_model()
        return {
            "library": "auto-round",
            "scheme": scheme,
            "iters": iters,
            "calibration_samples": len(texts),
            "calibration_seqlen": int(calibration.shape[1]),
            "tensor_types": dict(Counter(tensor_types(target).values())),
        }
