"""Compare the quality figures of two cards of the same build (e.g. a CPU run and a CUDA run, see gpu_check.sh).

Prints, per format and figure, both values and their difference; exits 1 when a difference exceeds its tolerance.
Tolerances are what a device change may move: float32 arithmetic in another order moves the reference by ~1e-5
relative; GGUF files are the same bytes (llama.cpp's CPU or CUDA kernels differ in summation order); torch
quantizers on a GPU take other rounding paths, so their artifacts differ and only their quality must agree roughly.

    .venv/bin/python scripts/compare_cards.py RUN_A/card.json RUN_B/card.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# figure -> (tolerance for files made the same way, tolerance for torch-quantized artifacts); absolute units of the
# figure (perplexity change in percentage points, KLD in nats, agreement as a fraction).
TOLERANCES = {
    "perplexity_increase_pct": (0.2, 1.5),
    "kld_mean": (0.002, 0.02),
    "top1_agreement": (0.01, 0.03),
}
REFERENCE_PERPLEXITY_RELATIVE = 1e-3


def figures(card: dict) -> dict[str, dict]:
    return {row["key"]: {**row.get("metrics", {}), "family": row.get("family")} for row in card["formats"]}


def compare(a: dict, b: dict) -> list[tuple[str, str, float, float, bool]]:
    rows = []
    ref_a, ref_b = a["reference"]["perplexity"], b["reference"]["perplexity"]
    rows.append(("reference", "perplexity", ref_a, ref_b, abs(ref_a - ref_b) / ref_a <= REFERENCE_PERPLEXITY_RELATIVE))
    fa, fb = figures(a), figures(b)
    for key in sorted(set(fa) & set(fb)):
        torch_made = fa[key]["family"] != "gguf"
        for name, limits in TOLERANCES.items():
            if name in fa[key] and name in fb[key]:
                va, vb = fa[key][name], fb[key][name]
                rows.append((key, name, va, vb, abs(va - vb) <= limits[torch_made]))
    missing = sorted(set(fa) ^ set(fb))
    for key in missing:
        rows.append((key, "present in both cards", float(key in fa), float(key in fb), False))
    return rows


# What must match for two cards' figures to be compared at all: the same text, windows and scored positions.
SAME_EVALUATION = ("context", "windows", "scoring")


def evaluation_difference(a: dict, b: dict) -> str | None:
    """What differs between the two cards' evaluations, or None."""
    older = {"scoring": "all"}  # cards made before the setting existed scored every position
    ea, eb = ({**older, **card["evaluation"]} for card in (a, b))
    for name in SAME_EVALUATION:
        if ea.get(name) != eb.get(name):
            return f"{name} {ea.get(name)} against {eb.get(name)}"
    if ea["text"].get("sha256") != eb["text"].get("sha256"):
        return "the evaluation text"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    a, b = (json.loads(Path(p).read_text()) for p in argv)
    differs = evaluation_difference(a, b)
    if differs:
        print(f"the two cards were not evaluated alike ({differs}): build both with the same evaluation settings",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = compare(a, b)
    print(f"{'format':14} {'figure':26} {'A':>12} {'B':>12} {'ok':>4}")
    for key, name, va, vb, ok in rows:
        print(f"{key:14} {name:26} {va:12.5f} {vb:12.5f} {'yes' if ok else 'NO':>4}")
    bad = [r for r in rows if not r[4]]
    print(f"{len(rows) - len(bad)} of {len(rows)} figures agree within tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
