"""How sure a figure on the card is: 95% intervals, and whether a target is met, missed, or within noise.

Perplexity change, KL divergence and top-1 agreement come from the same token windows for every format and for the
reference, so each is a *paired* comparison over windows: per window, the artifact's figure less the reference's on
the same tokens. What varies from window to window for both (some text is simply harder) cancels; what is left is
how much the comparison depends on which windows were scored. Windows, not tokens, are the unit, because tokens
within a window are strongly correlated.

Each figure is a ratio of per-window sums (e.g. KL summed over a window's tokens, over all tokens scored). Its
interval is Student's t on the figure's linearized per-window values, (x_i - r t_i) / mean(t), with n - 1 degrees
of freedom; the perplexity change's is made on the mean NLL difference d and mapped through 100 (e^d - 1). In
tests/test_uncertainty.py's simulation with heavy-tailed window noise it holds the truth 95.4-96.4% of the time at
4, 8 and 16 windows, where the percentile bootstrap used before held it 78-92%. Its weak side is a strongly skewed
per-window figure (KL lognormal across windows, sigma 0.5): 91-92%.

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
Z95 = 1.959963984540054
# Student's t, 97.5th percentile, for 1-30 degrees of freedom (scipy.stats.t.ppf; tests check these against it).
T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.306, 2.2622, 2.2281,
    2.201, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.093, 2.086,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip


def t975(df: int) -> float:
    """Student's t 97.5th percentile: the table, then the Cornish-Fisher series (within 1e-5 from 30 on)."""
    if df <= len(T975):
        return T975[df - 1]
    z = Z95
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def window_sums(nll: list[np.ndarray], ref_nll: list[np.ndarray], kld: list[np.ndarray], agree: list[np.ndarray]):
    """Per-window sums the intervals are made from, as JSON-able lists (one entry per window)."""
    return {
        "tokens": [int(len(n)) for n in nll],
        "nll": [float(np.sum(n, dtype=np.float64)) for n in nll],
        "ref_nll": [float(np.sum(r, dtype=np.float64)) for r in ref_nll],
        "kld": [float(np.sum(k, dtype=np.float64)) for k in kld],
        "agree": [int(np.sum(a)) for a in agree],
    }


def _figures(sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The card's figures from window sums."""
    tokens = sums["tokens"]
    return {
        "perplexity_increase_pct": 100.0 * np.expm1((sums["nll"] - sums["ref_nll"]) / tokens),
        "kld_mean": sums["kld"] / tokens,
        "top1_agreement": sums["agree"] / tokens,
    }


def ratio_interval(numerators: np.ndarray, denominators: np.ndarray) -> tuple[float, float]:
    """A 95% interval on sum(numerators) / sum(denominators) over n windows: t with n - 1 degrees of freedom on the
    ratio's linearized per-window values."""
    n = len(numerators)
    ratio = numerators.sum() / denominators.sum()
    linearized = (numerators - ratio * denominators) / denominators.mean()
    half = t975(n - 1) * linearized.std(ddof=1) / math.sqrt(n)
    return float(ratio - half), float(ratio + half)


def window_intervals(per_window: dict) -> dict[str, dict]:
    """metric -> {"low", "high", "n", "unit"}: each figure's 95% paired interval over its windows (see above)."""
    arrays = {name: np.asarray(values, dtype=np.float64) for name, values in per_window.items()}
    windows = len(arrays["tokens"])
    if windows < 2:
        return {}
    tokens = arrays["tokens"]
    low_nll, high_nll = ratio_interval(arrays["nll"] - arrays["ref_nll"], tokens)
    bounds = {
        "perplexity_increase_pct": (100.0 * math.expm1(low_nll), 100.0 * math.expm1(high_nll)),
        "kld_mean": ratio_interval(arrays["kld"], tokens),
        "top1_agreement": ratio_interval(arrays["agree"], tokens),
    }
    return {
        metric: {"low": low, "high": high, "n": windows, "unit": "windows"} for metric, (low, high) in bounds.items()
    }


def kld_ratio_interval(first: dict, second: dict) -> dict | None:
    """A 95% interval on (mean KL of ``first``) / (mean KL of ``second``), two artifacts scored on the same
    windows (the ratio of their per-window KL sums, linearized as above). None when the windows differ, there are
    fewer than two, or ``second`` has no KL."""
    if first["tokens"] != second["tokens"] or len(first["tokens"]) < 2:
        return None
    ours, theirs = np.asarray(first["kld"], dtype=np.float64), np.asarray(second["kld"], dtype=np.float64)
    if theirs.sum() <= 0:
        return None
    low, high = ratio_interval(ours, theirs)
    return {"low": low, "high": high, "n": len(ours), "unit": "windows"}


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
