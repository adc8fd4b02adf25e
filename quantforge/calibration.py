"""The calibration set: one set of token sequences per run, shared by every format that calibrates.

A set is named (a definition in ``calibration/``: ``c4``, ``wikitext2``, ...; ``auto`` is C4 where it can be had,
else the CPython docstring corpus that needs no download) or given as a local .txt/.jsonl file. Sampling is
deterministic from a seed, as GPTQ's reference code does it: pick documents long enough for one sequence, then a
random slice of each; short documents are joined when too few are long enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import QuantforgeError

AUTO = "auto"
OFFLINE_FALLBACK = "stdlib-docstrings"


@dataclass(frozen=True)
class CalibrationSettings:
    dataset: str = AUTO
    samples: int = 128
    seqlen: int = 512
    seed: int = 0

    def to_json(self) -> dict:
        return {"dataset": self.dataset, "samples": self.samples, "seqlen": self.seqlen, "seed": self.seed}


def load_calibration_text(name: str):
    from .textdata import load_text

    if name == AUTO:
        try:
            return load_text("c4")
        except QuantforgeError:
            return load_text(OFFLINE_FALLBACK)
    try:
        return load_text(name)
    except QuantforgeError as exc:
        raise QuantforgeError(
            f"calibration set '{name}' could not be loaded ({exc}); name a local .txt or .jsonl file with "
            "--calibration FILE"
        ) from None


def sample_sequences(documents: list[list[int]], settings: CalibrationSettings) -> np.ndarray:
    """``samples`` sequences of ``seqlen`` tokens, [samples, seqlen] int32, the same for the same seed."""
    rng = np.random.default_rng(settings.seed)
    long_enough = [doc for doc in documents if len(doc) >= settings.seqlen]
    if len(long_enough) >= settings.samples:
        chosen = rng.choice(len(long_enough), size=settings.samples, replace=False)
        rows = []
        for index in sorted(chosen):
            doc = long_enough[index]
            start = int(rng.integers(0, len(doc) - settings.seqlen + 1))
            rows.append(doc[start : start + settings.seqlen])
        return np.asarray(rows, dtype=np.int32)
    stream = np.concatenate([np.asarray(doc, dtype=np.int32) for doc in documents]) if documents else np.zeros(0)
    needed = settings.samples * settings.seqlen
    if len(stream) < needed:
        raise QuantforgeError(
            f"the calibration set has {len(stream)} tokens, fewer than the {needed} asked for "
            f"({settings.samples} samples x {settings.seqlen} tokens); use a larger set or lower --calib-samples"
        )
    starts = np.sort(rng.choice(len(stream) // settings.seqlen, size=settings.samples, replace=False))
    return np.stack([stream[s * settings.seqlen : (s + 1) * settings.seqlen] for s in starts]).astype(np.int32)


def tokenize_documents(tokenizer_dir, documents: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer(documents, add_special_tokens=False)["input_ids"]
