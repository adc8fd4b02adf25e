"""Intervals and "within noise" verdicts, on constructed data (pure functions), and on a measured run's card."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import read_json

from quantforge.decide import Candidate, Targets, decide
from quantforge.uncertainty import (
    mean_recovery_interval,
    paired_bootstrap,
    point_figures,
    recovery_interval,
    samples_to_settle,
    status,
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
    interval = paired_bootstrap(steady)["perplexity_increase_pct"]
    assert interval["low"] == pytest.approx(interval["high"]) == pytest.approx(100 * np.expm1(0.02))
    noisy = _windows(hard_and_easy, rng.normal(0.02, 0.05, size=32))
    wide = paired_bootstrap(noisy)["perplexity_increase_pct"]
    point = point_figures(noisy)["perplexity_increase_pct"]
    assert wide["low"] < point < wide["high"] and wide["high"] - wide["low"] > 1.0
    assert wide["n"] == 32 and wide["unit"] == "windows"


def test_intervals_narrow_as_one_over_the_square_root_of_the_windows():
    rng = np.random.default_rng(2)
    widths = {}
    for n in (16, 256):
        sums = _windows(rng.uniform(2, 3, size=n), rng.normal(0.02, 0.05, size=n))
        interval = paired_bootstrap(sums)["kld_mean"]
        widths[n] = interval["high"] - interval["low"]
    assert widths[16] / widths[256] == pytest.approx(4.0, rel=0.35)


def test_a_single_window_has_no_interval():
    assert paired_bootstrap(_windows(np.array([2.0]), np.array([0.1]))) == {}


def test_status_and_how_many_samples_settle_it():
    interval = {"low": 4.0, "high": 6.0, "n": 16, "unit": "windows"}
    assert status(4.5, interval, 5.0, upper=True) == "within noise"
    assert status(4.5, {"low": 4.2, "high": 4.8, "n": 16, "unit": "windows"}, 5.0, upper=True) == "met"
    assert status(5.5, {"low": 5.2, "high": 5.8, "n": 16, "unit": "windows"}, 5.0, upper=True) == "missed"
    assert status(0.97, {"low": 0.95, "high": 0.99, "n": 16, "unit": "windows"}, 0.98, upper=False) == "within noise"
    assert status(4.5, None, 5.0, upper=True) == "met"
    # half width 1.0 at a gap of 0.5: four times the windows, so 48 more
    assert samples_to_settle(4.5, interval, 5.0) == 48


def test_task_recovery_interval_by_the_delta_method():
    interval = recovery_interval(0.60, 0.03, 0.64, 0.03, n=200)
    recovery = 100 * 0.60 / 0.64
    half = 1.959963984540054 * recovery * np.hypot(0.03 / 0.60, 0.03 / 0.64)
    assert (interval["low"], interval["high"]) == pytest.approx((recovery - half, recovery + half))
    assert recovery_interval(0.6, None, 0.64, 0.03, n=200) is None
    mean = mean_recovery_interval([interval, interval])
    assert mean["high"] - mean["low"] == pytest.approx((interval["high"] - interval["low"]) / np.sqrt(2))


def _candidate(key: str, bits: float, value: float, low: float, high: float) -> Candidate:
    interval = {"perplexity_increase_pct": {"low": low, "high": high, "n": 16, "unit": "windows"}}
    return Candidate(key, "gguf", ("llama.cpp",), bits, int(bits * 1e8), {"perplexity_increase_pct": value}, interval)


def test_a_recommendation_resting_on_a_within_noise_call_says_so():
    candidates = [_candidate("q8", 8.5, 0.4, 0.2, 0.6), _candidate("q4", 4.9, 4.6, 3.8, 5.4)]
    decision = decide(candidates, Targets(max_ppl_increase=5), failures={})
    assert decision.recommended == "q8"
    q8, q4 = decision.verdicts
    assert "within noise" not in q8.reason and q8.checks[0]["status"] == "met"
    decision = decide([candidates[1]], Targets(max_ppl_increase=5))
    verdict = decision.verdicts[0]
    assert decision.recommended == "q4" and verdict.checks[0]["status"] == "within noise"
    assert "within noise: perplexity_increase_pct 4.60% [3.80, 5.40] vs 5.00%" in verdict.reason
    assert "about 48 more windows would settle it" in verdict.reason
    missed = decide([_candidate("q4", 4.9, 5.3, 4.6, 6.0)], Targets(max_ppl_increase=5)).verdicts[0]
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
