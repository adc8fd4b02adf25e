#!/usr/bin/env python3
"""gguf-auto against uniform Q4_K_M with the same importance matrix (issue 38's goal), on one model.

1. The run's Q4_K_M@imatrix: its size and mean KL divergence (with its 95% interval).
2. gguf-auto --max-kld <that KL>: the smallest mix whose KL's upper 95% bound meets Q4_K_M's mean KL.
   Goal: <= 0.9x Q4_K_M's size.
3. gguf-auto --max-kld <0.8 x that KL> --max-size <Q4_K_M's size>: at Q4_K_M's size, 0.8x its KL (upper bound).
   Goal: a file is found (the search reuses step 2's measurements: only its confirmations are new files).
Either goal is the issue's. The search's time is the quantize stage's, from the run's manifest.

    python scripts/bench_search.py                               # Qwen2.5-Coder-0.5B, 16 windows of 512 tokens
    python scripts/bench_search.py --model smollm2-135m          # 576-wide tensors: K-quants fall back there
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def build(model: str, out: Path, formats: str, backends: str, common: list[str], *targets: str) -> tuple[dict, str]:
    """One ``quantforge build``; returns the card and the failure line of gguf-auto, if it failed."""
    command = [sys.executable, "-m", "quantforge.cli", "build", model, "--out", str(out), "--formats", formats]
    command += ["--backend", backends, *common, *targets]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    print(f"  ({time.perf_counter() - started:.0f} s) {' '.join(command[3:])}", file=sys.stderr)
    failure = next((line for line in done.stderr.splitlines() if line.startswith("failed: gguf-auto")), "")
    if done.returncode != 0 and not failure:
        sys.exit(f"the build failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "card.json").read_text()), failure


def entry(card: dict, key: str) -> dict | None:
    return next((e for e in card["formats"] if e["key"] == key and e["complete"]), None)


def kld(e: dict) -> str:
    interval = e["intervals"]["kld_mean"]
    return f"{e['metrics']['kld_mean']:.4f} [{interval['low']:.4f}, {interval['high']:.4f}]"


def search_seconds(out: Path) -> float:
    return json.loads((out / "run.json").read_text())["stages"]["quantize/gguf-auto"]["seconds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-search")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    out = args.out / args.model
    common = ["--eval-text", str(WIKITEXT), "--ppl-windows", str(args.windows), "--ppl-context", str(args.context)]
    common += ["--threads", str(args.threads), "--no-speed"]

    card, _ = build(args.model, out, "gguf-q4km", "imatrix", common)
    q4 = entry(card, "gguf-q4km@imatrix")
    target = q4["metrics"]["kld_mean"]
    card, failed = build(args.model, out, "gguf-q4km,gguf-auto", "imatrix,ggufauto", common, "--max-kld", f"{target}")
    at_kld = entry(card, "gguf-auto")
    seconds = search_seconds(out) if at_kld else None
    shutil.copy(out / "card.md", out / "card-at-q4km-kld.md")
    size_gb = q4["size_bytes"] / 1e9
    stretch = ["--max-kld", f"{0.8 * target}", "--max-size", f"{size_gb}"]
    card, stretch_failed = build(args.model, out, "gguf-q4km,gguf-auto", "imatrix,ggufauto", common, *stretch)
    at_size = entry(card, "gguf-auto") if not stretch_failed else None

    print(f"\n{args.model}: {args.windows} windows of {args.context} tokens, {args.threads} threads")
    print(f"Q4_K_M@imatrix: {q4['size_bytes'] / 1e6:.1f} MB, {q4['bits_per_weight']:.2f} bpw, KL {kld(q4)}")
    if at_kld:
        ratio = at_kld["size_bytes"] / q4["size_bytes"]
        chosen = at_kld["quantize"]["search"]["chosen"]
        print(
            f"gguf-auto --max-kld {target:.4f}: {at_kld['size_bytes'] / 1e6:.1f} MB ({ratio:.3f}x; goal <= 0.9x), "
            f"{at_kld['bits_per_weight']:.2f} bpw, KL {kld(at_kld)}; search {seconds / 60:.1f} min (goal <= 60); "
            f"{len(at_kld['quantize']['search']['candidates'])} files; mix {chosen}"
        )
    else:
        print(f"gguf-auto --max-kld {target:.4f}: {failed}")
    if at_size:
        ratio = at_size["metrics"]["kld_mean"] / target
        separate = at_size["intervals"]["kld_mean"]["high"] < q4["intervals"]["kld_mean"]["low"]
        print(
            f"gguf-auto at Q4_K_M's size, --max-kld {0.8 * target:.4f}: {at_size['size_bytes'] / 1e6:.1f} MB, KL "
            f"{kld(at_size)} ({ratio:.3f}x; goal <= 0.8x), intervals {'apart' if separate else 'overlap'}; mix "
            f"{at_size['quantize']['search']['chosen']}"
        )
    else:
        print(f"gguf-auto at Q4_K_M's size, --max-kld {0.8 * target:.4f}: {stretch_failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
