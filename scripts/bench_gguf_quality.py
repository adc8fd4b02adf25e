#!/usr/bin/env python3
"""GGUF quality at equal size: auto-round's calibrated rounding against llama.cpp's own quantizer, plain and with
an importance matrix (llama-imatrix on the same calibration set), the baseline GGUF publishers actually ship.

Builds Q4_K_M and Q5_K_M with the three backends in one quantforge run (same calibration set, same evaluation
windows, all evaluated in llama.cpp) and prints, per format, each file's size, perplexity increase and mean KL
divergence, and the KL ratios with their 95% paired-bootstrap intervals over windows. Goal: auto-round <= 0.9x the
imatrix file's KL at equal size.

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
            "llamacpp,imatrix,autoround",
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
    pairs = {(p["better"], p["worse"]): p for p in card["same_format"]}

    def ratio(first: str, second: str) -> str:
        """KL of ``first`` over KL of ``second`` with its interval, whichever way the card ordered the pair."""
        if (first, second) in pairs:
            pair = pairs[(first, second)]
            value, interval = pair["kld_ratio"], pair["kld_ratio_interval"] or {}
            low, high = interval.get("low", float("nan")), interval.get("high", float("nan"))
        else:
            pair = pairs[(second, first)]
            value, interval = 1 / pair["kld_ratio"], pair["kld_ratio_interval"] or {}
            low, high = 1 / interval.get("high", float("nan")), 1 / interval.get("low", float("nan"))
        return f"{value:.3f} [{low:.3f}, {high:.3f}]"

    print(f"{'file':<20} {'bytes':>12} {'ppl +%':>8} {'KLD':>8}")
    for fmt in ("gguf-q4km", "gguf-q5km"):
        for key in (fmt, f"{fmt}@imatrix", f"{fmt}@autoround"):
            m, size = entries[key]["metrics"], entries[key]["size_bytes"]
            print(f"{key:<20} {size:>12,} {m['perplexity_increase_pct']:>8.2f} {m['kld_mean']:>8.4f}")
        print(f"  KLD imatrix / plain:       {ratio(f'{fmt}@imatrix', fmt)}")
        print(f"  KLD auto-round / plain:    {ratio(f'{fmt}@autoround', fmt)}")
        print(f"  KLD auto-round / imatrix:  {ratio(f'{fmt}@autoround', f'{fmt}@imatrix')}  (goal <= 0.9)")
    print("intervals: 95%, paired bootstrap over the evaluation windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
