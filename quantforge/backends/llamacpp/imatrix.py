"""GGUF K-quants with llama.cpp's importance matrix: the baseline that GGUF publishers actually ship.

The matrix (per weight matrix, the mean square of each input column's activations) is collected by llama.cpp's
own ``llama-imatrix`` running the run's F16 GGUF over the run's shared calibration set, and handed to llama.cpp's
``llama-quantize --imatrix``; both are built from the same llama.cpp as the library that loads the files
(``tools.py`` here). The matrix is an intermediate of the run: made once, used by every asked K-quant.

llama-imatrix reads text, not token ids: the calibration sequences are decoded back to text and llama.cpp cuts
the re-tokenized text into chunks of the same length, as many as there are sequences (a chunk fewer when the
re-tokenized text comes out shorter), each starting with BOS when the model adds one.
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from ...device import llama_tool_gpu_args
from ...logs import run_logged
from ...openmp import wait_briefly
from .. import Intermediate, QuantizeJob
from . import (
    F16_GGUF,
    FILE_TYPES,
    NEEDS_IMATRIX,
    LlamaCppBackend,
    _gguf_format,
    fallback_tensors,
    tensor_types,
)

# Q8_0 and F16 ignore an importance matrix; the K-quants, Q4_0 and the IQ types use it to weight each column's
# rounding error, and the IQ2/IQ3 types are made only with one (NEEDS_IMATRIX: this backend is their default).
IMATRIX_FORMATS = tuple(name for name in FILE_TYPES if name not in ("gguf-f16", "gguf-q8_0"))


def joined_calibration_text(tokenizer, calibration: np.ndarray) -> str:
    """The calibration sequences decoded back to text, one paragraph each, for llama-imatrix to re-tokenize."""
    return "\n\n".join(tokenizer.decode(row, skip_special_tokens=True) for row in calibration)


def calibration_text(job: QuantizeJob) -> tuple[str, int, int]:
    """The run's calibration set as llama-imatrix's text: (text, sequences, tokens per sequence)."""
    from transformers import AutoTokenizer

    from ..hf import load_calibration

    calibration = load_calibration(job.calibration)
    tokenizer = AutoTokenizer.from_pretrained(job.source.path)
    return joined_calibration_text(tokenizer, calibration), int(calibration.shape[0]), int(calibration.shape[1])


def _run_tool(command: list[str], log_path: Path, what: str, cwd: Path | None = None) -> str:
    wait_briefly()
    return run_logged(command, log_path, what, cwd)


def build_importance_matrix(job: QuantizeJob) -> dict:
    from .tools import build_tools

    tool = build_tools(log=job.log)["llama-imatrix"]
    text, sequences, seqlen = calibration_text(job)
    # Both tools write the names they were given into their output (imatrix.datasets, quantize.imatrix.file):
    # plain file names, run from the files' folders, keep local paths out of published GGUFs.
    dataset = f"{job.source.name}-calibration-{sequences}x{seqlen}.txt"
    with tempfile.TemporaryDirectory(prefix="quantforge-imatrix-") as scratch:
        (Path(scratch) / dataset).write_text(text)
        command = [str(tool), "-m", str(job.intermediate("gguf-f16").resolve()), "-f", dataset]
        command += ["-o", str(job.out.resolve())]
        command += ["-c", str(seqlen), "-b", str(seqlen), "--chunks", str(sequences), "-t", str(job.threads)]
        command += ["--no-ppl", "--output-format", "gguf", *llama_tool_gpu_args(job.device)]
        output = _run_tool(command, job.log_dir / "imatrix.log", "llama.cpp's llama-imatrix", cwd=Path(scratch))
    chunks = re.findall(r"computing over (\d+) chunks", output)
    return {
        "tool": "llama.cpp llama-imatrix",
        "chunks": int(chunks[-1]) if chunks else None,
        "chunk_tokens": seqlen,
        "calibration_samples": sequences,
    }


IMPORTANCE_MATRIX = Intermediate(".gguf", build_importance_matrix, needs=("gguf-f16",), uses_calibration=True)


class LlamaCppImatrixBackend(LlamaCppBackend):
    name = "imatrix"
    formats = {name: _gguf_format(name) for name in IMATRIX_FORMATS}
    alternative_for = frozenset(IMATRIX_FORMATS) - frozenset(NEEDS_IMATRIX)
    needs_calibration = True

    def check(self, source, fmt, settings: dict) -> list[str]:
        from .tools import PRODUCT_TOOLS, cmake_path, find_tool

        if any(find_tool(name) is None for name in PRODUCT_TOOLS):
            cmake_path()  # they will be built on first use; without cmake, a one-line error now, before any work
        return super().check(source, fmt, settings)

    def intermediates(self, fmt) -> dict:
        return {"gguf-f16": F16_GGUF, "imatrix": IMPORTANCE_MATRIX}

    def quantize(self, job: QuantizeJob) -> dict:
        from .convert import describe
        from .tools import build_tools

        tool = build_tools(log=job.log)["llama-quantize"]
        scheme = FILE_TYPES[job.format.name][0]
        imatrix = job.intermediate("imatrix")
        job.out.mkdir(parents=True)
        # "-imat": beside the plain and AutoRound files of the same type, in one Hub repo, no name is shared
        target = job.out / f"{job.source.name}-{scheme}-imat.gguf"
        command = [
            str(tool),
            "--imatrix",
            imatrix.name,
            str(job.intermediate("gguf-f16").resolve()),
            str(target.resolve()),
        ]
        log_path = job.log_dir / f"{job.format.name}-imatrix.log"
        output = _run_tool([*command, scheme, str(job.threads)], log_path, "llama-quantize", cwd=imatrix.parent)
        sequences, seqlen = np.load(job.calibration, mmap_mode="r").shape
        return {
            "converter": describe(),
            "quantizer": "llama.cpp llama-quantize --imatrix",
            "calibration_samples": int(sequences),
            "calibration_seqlen": int(seqlen),
            "fallback_tensors": fallback_tensors(output),
            "tensor_types": dict(Counter(tensor_types(target).values())),
        }
