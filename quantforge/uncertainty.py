"""How sure a figure on the card is: 95% intervals, and whether a target is met, missed, or within noise.

Perplexity change, KL divergence and top-1 agreement come from the same token windows for every format and for the
reference, so their uncertainty is estimated by a *paired* bootstrap over windows: each resample draws windows with
replacement and recomputes the artifact's and the reference's figures on the same draw. What varies from window to
window for both (some text is simply harder) cancels; what is left is how much the comparison depends on which
windows were scored. Windows, not tokens, are resampled because tokens within a window are strongly correlated.

Task accuracies come with lm-evaluation-harness's standard error; the recovery (artifact / reference accuracy) gets
a normal interval by the delta method, treating the two as independent. They are scored on the same examples and
so positively correlated, which makes this interval wider than the truth: a "within noise" call on a task is a
cautious one.

Pure functions of numbers: no torch, no files.
"""

from __future__ import annotations

import math

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 2000
Z95 = 1.959963984540054


def window_sums(nll: list[np.ndarray], ref_nll: list[np.ndarray], kld: list[np.ndarray], agree: list[np.ndarray]):
    """Per-window sums the bootstrap resamples, as JSON-able lists (one entry per window)."""
    return {
        "tokens": [int(len(n)) for n in nll],
        "nll": [float(np.sum(n, dtype=np.float64)) for n in nll],
        "ref_nll": [float(np.sum(r, dtype=np.float64)) for r in ref_nll],
        "kld": [float(np.sum(k, dtype=np.float64)) for k in kld],
        "agree": [int(np.sum(a)) for a in agree],
    }


def _figures(sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The card's figures from (possibly resampled) window sums; arrays broadcast over resamples."""
    tokens = sums["tokens"]
    return {
        "perplexity_increase_pct": 100.0 * np.expm1((sums["nll"] - sums["ref_nll"]) / tokens),
        "kld_mean": sums["kld"] / tokens,
        "top1_agreement": sums["agree"] / tokens,
    }


def paired_bootstrap(per_window: dict, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict[str, dict]:
    """metric -> {"low", "high", "n", "unit"}: the 95% percentile interval over ``samples`` window resamples."""
    arrays = {name: np.asarray(values, dtype=np.float64) for name, values in per_window.items()}
    windows = len(arrays["tokens"])
    if windows < 2:
        return {}
    draws = np.random.default_rng(seed).integers(0, windows, size=(samples, windows))
    resampled = _figures({name: values[draws].sum(axis=1) for name, values in arrays.items()})
    tail = 100 * (1 - CONFIDENCE) / 2
    return {
        metric: {
            "low": float(np.percentile(values, tail)),
            "high": float(np.percentile(values, 100 - tail)),
            "n": windows,
            "unit": "windows",
        }
        for metric, values in resampled.items()
    }


def kld_ratio_interval(first: dict, second: dict, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict | None:
    """A 95% interval on (mean KL of ``first``) / (mean KL of ``second``), two artifacts scored on the same
    windows: the same paired bootstrap, each resample summing both over the same drawn windows. None when the
    windows differ or there are fewer than two."""
    if first["tokens"] != second["tokens"] or len(first["tokens"]) < 2:
        return None
    ours, theirs = np.asarray(first["kld"], dtype=np.float64), np.asarray(second["kld"], dtype=np.float64)
    draws = np.random.default_rng(seed).integers(0, len(ours), size=(samples, len(ours)))
    denominators = theirs[draws].sum(axis=1)
    if (denominators <= 0).any():
        return None
    ratios = ours[draws].sum(axis=1) / denominators
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return {"low": float(low), "high": float(high), "n": len(ours), "unit": "windows"}


def point_figures(per_window: dict) -> dict[str, float]:
    """The figures of all windows together (equal to the evaluation's own means)."""
    sums = {name: np.asarray(values, dtype=np.float64).sum() for name, values in per_window.items()}
    return {metric: float(value) for metric, value in _figures(sums).items()}


def recovery_interval(value: float, stderr: float | None, reference: float, reference_stderr: float | None, n: int):
    """A 95% interval on 100 x value / reference (delta method), or None without both standard errors."""
    if stderr is None or reference_stderr is None or not value or not reference:
        return None
    recovery = 100.0 * value / reference
    relative = math.sqrt((stderr / value) ** 2 + (reference_stderr / reference) ** 2)
    half = Z95 * recovery * relative
    return {"low": recovery - half, "high": recovery + half, "n": n, "unit": "examples"}


def mean_recovery_interval(intervals: list[dict]) -> dict | None:
    """The interval of a mean of independent recoveries (normal, from each interval's half width)."""
    if not intervals:
        return None
    centres = [(i["low"] + i["high"]) / 2 for i in intervals]
    half = math.sqrt(sum(((i["high"] - i["low"]) / 2) ** 2 for i in intervals)) / len(intervals)
    mean = sum(centres) / len(centres)
    return {"low": mean - half, "high": mean + half, "n": min(i["n"] for i in intervals), "unit": "examples"}


def status(value: float, interval: dict | None, limit: float, upper: bool) -> str:
    """ "met", "missed", or "within noise" when the interval holds values on both sides of the limit."""
    met = value <= limit if upper else value >= limit
    if interval is not None and interval["low"] < limit < interval["high"]:
        return "within noise"
    return "met" if met else "missed"


def samples_to_settle(value: float, interval: dict, limit: float) -> int | None:
    """About how many more windows (or examples) would narrow the interval until it clears the limit: an
    interval's half width shrinks as 1/sqrt(n). None when the estimate sits on the limit itself."""
    gap = abs(value - limit)
    half = (interval["high"] - interval["low"]) / 2
    if gap == 0 or half == 0:
        return None
    needed = math.ceil(interval["n"] * (half / gap) ** 2)
    return max(needed - interval["n"], 1)
