#!/usr/bin/env python3
"""GGUF quality at equal size: auto-round's calibrated rounding against llama.cpp's own quantizer.

Builds Q4_K_M and Q5_K_M with both backends in one quantforge run (same calibration set, same evaluation windows,
all evaluated in llama.cpp) and prints, per format, the size and the ratios of the perplexity increase and the mean
KL divergence of auto-round's file to llama.cpp's. Goal: <= 0.9x llama.cpp's loss at equal size.

    python scripts/bench_gguf_quality.py                     # SmolLM2-135M, WikiText-2 test
    python scripts/bench_gguf_quality.py --model DIR --out runs/bench-gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, help="run directory (default: a temporary one)")
    parser.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"))
    parser.add_argument(
        "--calibration", default=str(ROOT.parent / "shared" / "data" / "calibration" / "c4-en-train-00000-sample.jsonl")
    )
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run = args.out or Path(scratch) / "run"
        command = [
            sys.executable,
            "-m",
            "quantforge.cli",
            "build",
            args.model,
            "--formats",
            "gguf-q4km,gguf-q5km",
            "--backend",
            "llamacpp,autoround",
            "--out",
            str(run),
            "--eval-text",
            args.text,
            "--ppl-context",
            "512",
            "--ppl-windows",
            str(args.windows),
            "--calibration",
            args.calibration,
            "--calib-samples",
            str(args.samples),
            "--calib-seqlen",
            str(args.seqlen),
            "--no-speed",
            "--json",
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        card = json.loads(done.stdout)
    entries = {e["key"]: e for e in card["formats"]}
    print(
        f"{args.model}: {card['evaluation']['windows']} windows of {card['evaluation']['context']} tokens of "
        f"{card['evaluation']['text']['name']}; reference perplexity {card['reference']['perplexity']:.3f}"
    )
    print(
        f"{'format':<10} {'bytes (llama.cpp)':>18} {'bytes (auto-round)':>19} {'ppl +% l.cpp':>12} "
        f"{'ppl +% a-r':>10} {'ppl ratio':>9} {'KLD l.cpp':>9} {'KLD a-r':>8} {'KLD ratio':>9}"
    )
    for fmt in ("gguf-q4km", "gguf-q5km"):
        plain, calibrated = entries[fmt], entries[f"{fmt}@autoround"]
        p, c = plain["metrics"], calibrated["metrics"]
        print(
            f"{fmt:<10} {plain['size_bytes']:>18,} {calibrated['size_bytes']:>19,} "
            f"{p['perplexity_increase_pct']:>12.2f} {c['perplexity_increase_pct']:>10.2f} "
            f"{c['perplexity_increase_pct'] / p['perplexity_increase_pct']:>9.3f} {p['kld_mean']:>9.4f} "
            f"{c['kld_mean']:>8.4f} {c['kld_mean'] / p['kld_mean']:>9.3f}"
        )
    print("goal: ratios <= 0.9 at equal size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
