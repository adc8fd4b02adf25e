"""Intervals and "within noise" verdicts, on constructed data (pure functions), and on a measured run's card."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import read_json

from quantforge.decide import Candidate, Targets, decide
from quantforge.uncertainty import (
    mean_recovery_interval,
    point_figures,
    recovery_interval,
    samples_to_settle,
    status,
    window_intervals,
)


def _windows(ref_nll: np.ndarray, shift: np.ndarray, tokens: int = 100) -> dict:
    """Per-window sums of a format whose per-token NLL is the reference's plus ``shift`` (one value per window)."""
    n = len(ref_nll)
    return {
        "tokens": [tokens] * n,
        "nll": list((ref_nll + shift) * tokens),
        "ref_nll": list(ref_nll * tokens),
        "kld": list(np.abs(shift) * tokens),
        "agree": [int(tokens * 0.9)] * n,
    }


def test_the_bootstrap_is_paired_over_windows():
    """Windows that differ a lot in difficulty but move together: the interval on the change stays narrow."""
    rng = np.random.default_rng(1)
    hard_and_easy = rng.uniform(1.0, 5.0, size=32)  # the reference's per-token NLL varies 5x between windows
    steady = _windows(hard_and_easy, np.full(32, 0.02))
    interval = window_intervals(steady)["perplexity_increase_pct"]
    assert interval["low"] == pytest.approx(interval["high"]) == pytest.approx(100 * np.expm1(0.02))
    noisy = _windows(hard_and_easy, rng.normal(0.02, 0.05, size=32))
    wide = window_intervals(noisy)["perplexity_increase_pct"]
    point = point_figures(noisy)["perplexity_increase_pct"]
    assert wide["low"] < point < wide["high"] and wide["high"] - wide["low"] > 1.0
    assert wide["n"] == 32 and wide["unit"] == "windows"


def test_intervals_narrow_as_one_over_the_square_root_of_the_windows():
    rng = np.random.default_rng(2)
    widths = {}
    for n in (16, 256):
        sums = _windows(rng.uniform(2, 3, size=n), rng.normal(0.02, 0.05, size=n))
        interval = window_intervals(sums)["kld_mean"]
        widths[n] = interval["high"] - interval["low"]
    assert widths[16] / widths[256] == pytest.approx(4.0, rel=0.35)


def test_a_single_window_has_no_interval():
    assert window_intervals(_windows(np.array([2.0]), np.array([0.1]))) == {}


def test_status_and_how_many_samples_settle_it():
    interval = {"low": 4.0, "high": 6.0, "n": 16, "unit": "windows"}
    assert status(4.5, interval, 5.0, upper=True) == "within noise"
    assert status(4.5, {"low": 4.2, "high": 4.8, "n": 16, "unit": "windows"}, 5.0, upper=True) == "met"
    assert status(5.5, {"low": 5.2, "high": 5.8, "n": 16, "unit": "windows"}, 5.0, upper=True) == "missed"
    assert status(0.97, {"low": 0.95, "high": 0.99, "n": 16, "unit": "windows"}, 0.98, upper=False) == "within noise"
    assert status(4.5, None, 5.0, upper=True) == "met"
    # half width 1.0 at a gap of 0.5: four times the windows, so 48 more
    assert samples_to_settle(4.5, interval, 5.0) == 48


def _coverage(make_windows, truth: dict, n: int, experiments: int, seed: int) -> dict[str, float]:
    """The share of ``experiments`` simulated runs of ``n`` windows whose 95% interval holds the known truth."""
    rng = np.random.default_rng(seed)
    held = dict.fromkeys(truth, 0)
    for _ in range(experiments):
        intervals = window_intervals(make_windows(rng, n))
        for metric, value in truth.items():
            held[metric] += intervals[metric]["low"] <= value <= intervals[metric]["high"]
    return {metric: count / experiments for metric, count in held.items()}


TOKENS = 512  # per window, as the default evaluation scores them
SHIFT, KLD, AGREE = 0.02, 0.05, 0.9  # true per-token NLL change, mean KL and top-1 agreement


def _heavy_tailed(rng, n):
    """Windows whose difficulty varies 5x for both sides alike, and whose paired figures carry Student-t (3 degrees
    of freedom) noise: infinite kurtosis, the heavy tail the issue's simulation used."""
    ref = rng.uniform(1.0, 5.0, n)
    return {
        "tokens": [TOKENS] * n,
        "nll": list((ref + SHIFT + 0.03 * rng.standard_t(3, n)) * TOKENS),
        "ref_nll": list(ref * TOKENS),
        "kld": list((KLD + 0.02 * rng.standard_t(3, n)) * TOKENS),
        "agree": list((AGREE + 0.03 * rng.standard_t(3, n)) * TOKENS),
    }


def _skewed_kld(rng, n):
    """Per-window mean KL lognormal around the truth (sigma 0.5): a few windows far worse than the rest."""
    sigma = 0.5
    ref = rng.uniform(1.0, 5.0, n)
    return {
        "tokens": [TOKENS] * n,
        "nll": list(ref * TOKENS),
        "ref_nll": list(ref * TOKENS),
        "kld": list(KLD * rng.lognormal(-(sigma**2) / 2, sigma, n) * TOKENS),
        "agree": [TOKENS] * n,
    }


# Measured (4000 experiments, seed = windows): the t interval 95.7-96.4% at 4 windows, 95.7-95.9% at 8, 95.4-96.1%
# at 16 over the three figures. The percentile bootstrap it replaced, on the same simulation (1000 experiments, 500
# resamples): 78-80% at 4, 85-87% at 8, 88-92% at 16.
@pytest.mark.parametrize("windows", [4, 8, 16])
def test_intervals_hold_95_percent_at_few_windows_under_heavy_tailed_noise(windows):
    truth = {"perplexity_increase_pct": 100 * np.expm1(SHIFT), "kld_mean": KLD, "top1_agreement": AGREE}
    coverage = _coverage(_heavy_tailed, truth, windows, experiments=4000, seed=windows)
    for metric, share in coverage.items():
        assert 0.93 <= share <= 0.97, (metric, windows, coverage)


# Measured: 91.2% at 4 windows, 92.4% at 8, 92.4% at 16 (seed = windows). A mean of strongly skewed values is the
# t interval's known weak side; the module's text says so rather than the card claiming 95% there.
@pytest.mark.parametrize("windows", [4, 8, 16])
def test_coverage_of_skewed_per_window_kl_is_known_and_stated(windows):
    coverage = _coverage(_skewed_kld, {"kld_mean": KLD}, windows, experiments=4000, seed=windows)
    assert 0.89 <= coverage["kld_mean"] <= 0.97, coverage


def test_the_t_quantiles_are_scipys():
    from scipy import stats

    from quantforge.uncertainty import t975

    for df in (1, 2, 3, 7, 15, 30, 31, 45, 100, 1000):
        assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-4), df


def test_task_recovery_interval_covers_the_true_ratio_of_independent_accuracies():
    """Simulated: two accuracies scored on 400 examples each, independently (the case the delta method assumes);
    the interval on 100 x artifact / reference holds the true 93.75% about 95% of the time (measured 94.9%)."""
    rng = np.random.default_rng(3)
    examples, truth_artifact, truth_reference, experiments = 400, 0.60, 0.64, 4000
    held = 0
    for _ in range(experiments):
        value = rng.binomial(examples, truth_artifact) / examples
        reference = rng.binomial(examples, truth_reference) / examples
        stderr = np.sqrt(value * (1 - value) / (examples - 1))
        reference_stderr = np.sqrt(reference * (1 - reference) / (examples - 1))  # lm-eval's sample stderr
        interval = recovery_interval(value, stderr, reference, reference_stderr, n=examples)
        held += interval["low"] <= 100 * truth_artifact / truth_reference <= interval["high"]
    assert 0.93 <= held / experiments <= 0.97, held / experiments
    assert recovery_interval(0.6, None, 0.64, 0.03, n=200) is None
    # a mean of independent recoveries: half widths add in quadrature
    interval = recovery_interval(0.60, 0.03, 0.64, 0.03, n=200)
    mean = mean_recovery_interval([interval, interval])
    assert mean["high"] - mean["low"] == pytest.approx((interval["high"] - interval["low"]) / np.sqrt(2))


def _candidate(key: str, bits: float, value: float, low: float, high: float) -> Candidate:
    interval = {"perplexity_increase_pct": {"low": low, "high": high, "n": 16, "unit": "windows"}}
    return Candidate(key, "gguf", ("llama.cpp",), bits, int(bits * 1e8), {"perplexity_increase_pct": value}, interval)


def test_a_recommendation_resting_on_a_within_noise_call_says_so():
    candidates = [_candidate("q8", 8.5, 0.4, 0.2, 0.6), _candidate("q4", 4.9, 4.6, 3.8, 5.4)]
    decision = decide(candidates, Targets(max_ppl_increase=5, max_kld=None), failures={})
    assert decision.recommended == "q8"
    q8, q4 = decision.verdicts
    assert "within noise" not in q8.reason and q8.checks[0]["status"] == "met"
    decision = decide([candidates[1]], Targets(max_ppl_increase=5, max_kld=None))
    verdict = decision.verdicts[0]
    assert decision.recommended == "q4" and verdict.checks[0]["status"] == "within noise"
    assert "within noise: perplexity_increase_pct 4.60% [3.80, 5.40] vs 5.00%" in verdict.reason
    assert "about 48 more windows would settle it" in verdict.reason
    missed = decide([_candidate("q4", 4.9, 5.3, 4.6, 6.0)], Targets(max_ppl_increase=5, max_kld=None)).verdicts[0]
    assert missed.outcome == "misses targets" and "within noise: perplexity_increase_pct 5.30%" in missed.reason


def test_the_card_of_a_measured_run_shows_intervals(tiny_run):
    card = read_json(tiny_run / "card.json")
    for entry in card["formats"]:
        for metric in ("perplexity_increase_pct", "kld_mean", "top1_agreement"):
            interval = entry["intervals"][metric]
            assert interval["low"] <= entry["metrics"][metric] <= interval["high"], (entry["key"], metric)
        # a recovery has an interval wherever it exists (a task the tiny reference scores 0 on has neither)
        recoveries = {k for k in entry["metrics"] if k.startswith("task_recovery_pct")}
        assert recoveries and recoveries == {k for k in entry["intervals"] if k.startswith("task_recovery_pct")}
    markdown = (tiny_run / "card.md").read_text()
    assert "Intervals in brackets are 95%" in markdown
    change = card["formats"][0]["intervals"]["perplexity_increase_pct"]
    assert f"[{change['low']:+.2f}, {change['high']:+.2f}]" in markdown


def test_run_to_run_comparison_fails_on_a_single_window_scored_differently(tiny_run):
    """The resume and Ray tests compare cards with assert_same_results: one window off by 0.1% must fail it,
    although the mean over every window moves less than the tolerance on the means."""
    import copy

    from conftest import assert_same_results

    card = read_json(tiny_run / "card.json")
    assert_same_results(card, copy.deepcopy(card))
    perturbed = copy.deepcopy(card)
    windows = perturbed["formats"][1]["per_window"]
    windows["nll"][2] *= 1.001
    with pytest.raises(AssertionError, match="window 2 nll"):
        assert_same_results(card, perturbed)


def test_kld_ratio_interval_of_two_files_on_the_same_windows():
    from quantforge.uncertainty import kld_ratio_interval

    rng = np.random.default_rng(1)
    tokens = [100] * 40
    hardness = rng.uniform(0.5, 2.0, 40)  # some windows are harder for both files alike: the pairing cancels it
    worse = {"tokens": tokens, "kld": list(100 * 0.02 * hardness)}
    clearly = {"tokens": tokens, "kld": list(100 * 0.015 * hardness * rng.normal(1, 0.02, 40))}
    barely = {"tokens": tokens, "kld": list(100 * 0.0198 * hardness * rng.normal(1, 0.05, 40))}
    interval = kld_ratio_interval(clearly, worse)
    assert interval["low"] < 0.75 < interval["high"] < 1 and interval["n"] == 40
    noisy = kld_ratio_interval(barely, worse)
    assert noisy["low"] < 1 < noisy["high"]  # a 1% difference under 5% per-window noise: within noise
    assert kld_ratio_interval(clearly, {"tokens": tokens[:-1], "kld": worse["kld"][:-1]}) is None  # other windows
