#!/usr/bin/env python3
"""Backend overhead and multi-format savings, measured in one session on this machine.

1. For each torch format: wall time and peak RSS of quantforge's backend (``Backend.quantize`` on a QuantizeJob)
   against the library's own entry point called directly (GPTQModel.load/quantize/save, llm-compressor oneshot),
   on the same model and calibration tokens, each in a fresh process. Goal: ratio <= 1.05.
2. One ``quantforge build`` of all four torch formats against the sum of four single-format builds (each of those
   redoes the reference, the calibration set and the model facts). Goal: ratio <= 0.8.

    python scripts/bench_backends.py                      # a tiny synthetic llama (seconds per format)
    python scripts/bench_backends.py --model DIR --samples 16 --seqlen 256
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

DIRECT = {
    "gptq-int4": """
import os, sys, numpy as np, torch
from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
calib = np.load(sys.argv[2])
samples = [{"input_ids": torch.as_tensor(r, dtype=torch.long)[None], "attention_mask": torch.ones(1, len(r), dtype=torch.long)} for r in calib]
model = GPTQModel.load(sys.argv[1], QuantizeConfig(bits=4, group_size=int(sys.argv[4]), desc_act=False, sym=True, offload_to_disk=False), dtype=torch.bfloat16)
model.quantize(samples, batch_size=1, backend=BACKEND.TORCH)
model.save(sys.argv[3])
""",
    "int8": """
import sys, numpy as np, torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
from transformers import AutoModelForCausalLM
calib = np.load(sys.argv[2])
ds = Dataset.from_dict({"input_ids": [r.tolist() for r in calib], "attention_mask": [[1] * calib.shape[1]] * calib.shape[0]})
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
oneshot(model=model, dataset=ds, recipe=[SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])], max_seq_length=calib.shape[1], num_calibration_samples=calib.shape[0])
model.save_pretrained(sys.argv[3], save_compressed=True)
""",
}

VIA_QUANTFORGE = """
import sys, numpy as np
from pathlib import Path
from quantforge.backends import QuantizeJob, load_backends, resolve_formats
from quantforge.source import ModelSpec, fetch
source = fetch(ModelSpec("local", sys.argv[1], "bench"), log=lambda m: None)
choice = resolve_formats([sys.argv[5]], None, load_backends())[0]
job = QuantizeJob(source, choice.format, {"group_size": int(sys.argv[4]), "act_order": False}, Path(sys.argv[3]),
                  intermediate=None, log_dir=Path(sys.argv[3] + "-logs"), calibration=Path(sys.argv[2]), threads=2)
choice.backend.quantize(job)
"""

# Peak RSS from /proc/self/status VmHWM (kB), the high-water mark of this process's own memory since its exec:
# ru_maxrss is not, as Linux carries over at exec the peak of the forked copy of a (large) parent.
REPORT = "import sys; print('MAXRSS', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr)"


def timed(args: list[str], env: dict | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of a fresh Python process running ``args``."""
    started = time.perf_counter()
    result = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(args[:3])}\n{result.stderr[-3000:]}")
    rss = [line.split()[1] for line in result.stderr.splitlines() if line.startswith("MAXRSS")]
    return seconds, (int(rss[-1]) / 1024 if rss else float("nan"))


def python_snippet(code: str, *argv: str) -> list[str]:
    return [sys.executable, "-c", code + "\n" + REPORT, *argv]


def build_seconds(model: Path, formats: str, out: Path, samples: int, seqlen: int, text: str) -> float:
    command = [
        sys.executable,
        "-m",
        "quantforge.cli",
        "build",
        str(model),
        "--formats",
        formats,
        "--out",
        str(out),
        "--calib-samples",
        str(samples),
        "--calib-seqlen",
        str(seqlen),
        "--eval-text",
        text,
        "--ppl-context",
        "256",
        "--ppl-windows",
        "4",
        "--group-size",
        "auto",
    ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"quantforge build failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="HF folder (default: a tiny synthetic llama)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--text", default="pydoc", help="evaluation text for the build comparison")
    args = parser.parse_args()
    env = {"GPTQMODEL_CPU_WORKERS": "2", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    os.environ.update(env)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model = args.model
        if model is None:
            from tiny_models import build_tiny_model

            from quantforge.source import BUNDLED

            model = build_tiny_model("llama", BUNDLED["smollm2-135m"](print), scratch / "tiny-llama")
        import numpy as np

        from quantforge.backends.hf import resolve_group_size
        from quantforge.calibration import (
            CalibrationSettings,
            load_calibration_text,
            sample_sequences,
            tokenize_documents,
        )
        from quantforge.source import model_facts

        group, _ = resolve_group_size(model_facts(model), "auto")
        text = load_calibration_text("auto")
        calibration = sample_sequences(
            tokenize_documents(model, text.documents), CalibrationSettings(samples=args.samples, seqlen=args.seqlen)
        )
        calib_path = scratch / "calibration.npy"
        np.save(calib_path, calibration)
        print(f"model {model.name}, calibration {text.name} {args.samples} x {args.seqlen}, group {group}")
        print(
            f"{'format':<10} {'direct s':>9} {'ours s':>9} {'time ratio':>10} {'direct MB':>10} {'ours MB':>9} "
            f"{'RSS ratio':>9}"
        )
        for fmt, code in DIRECT.items():
            direct = timed(python_snippet(code, str(model), str(calib_path), str(scratch / f"d-{fmt}"), str(group)))
            ours = timed(
                python_snippet(VIA_QUANTFORGE, str(model), str(calib_path), str(scratch / f"q-{fmt}"), str(group), fmt)
            )
            print(
                f"{fmt:<10} {direct[0]:>9.1f} {ours[0]:>9.1f} {ours[0] / direct[0]:>10.3f} {direct[1]:>10.0f} "
                f"{ours[1]:>9.0f} {ours[1] / direct[1]:>9.3f}"
            )
        formats = ["gptq-int4", "gptq-int8", "awq", "int8"]
        together = build_seconds(model, ",".join(formats), scratch / "all", args.samples, args.seqlen, args.text)
        apart = sum(
            build_seconds(model, f, scratch / f"one-{f}", args.samples, args.seqlen, args.text) for f in formats
        )
        print(
            f"one build of {len(formats)} formats: {together:.1f} s; {len(formats)} single-format builds: "
            f"{apart:.1f} s; ratio {together / apart:.3f} (goal <= 0.8)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
