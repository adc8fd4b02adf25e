"""Distribution shift, task accuracy and the speed probe, on real runs of the tiny model."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST_EVAL, TASKS_DATA, TINY_RUN_ARGS, WIKITEXT, build_run, quantforge_cli, read_json

from quantforge.evaluate import (
    NonFiniteLogits,
    compare_window,
    reference_window,
    score_artifact,
    score_reference,
    tokenize_text,
)
from quantforge.runners import TorchRunner


def test_kl_of_the_reference_against_itself_is_zero(tiny_llama):
    tokens = np.arange(100, 164, dtype=np.int32)
    logits = TorchRunner.from_folder(tiny_llama, threads=2).logits(tokens)
    ref = reference_window(logits, tokens)
    same = compare_window(logits, tokens, ref)
    assert np.allclose(same["kld"], 0.0, atol=1e-6)  # log-probs are stored as float32
    assert same["agree"].all()
    assert np.allclose(same["nll"], ref.nll)
    shifted = compare_window(logits + np.random.default_rng(0).normal(0, 0.5, logits.shape), tokens, ref)
    assert shifted["kld"].mean() > 1e-3 and not shifted["agree"].all()


def test_the_kl_estimate_is_unbiased_against_exact_full_vocabulary_kl(smollm2_dir):
    """Issue 36: the card's KLD keeps each position's 64 top reference tokens exactly and samples the rest. Over 2048
    positions of SmolLM2 on wikitext, against an artifact whose logits carry noise on the whole vocabulary (the
    hardest case for a sampled tail), the estimate's mean is exact full-softmax KL (torch's kl_div in float64)
    within 3 standard errors of the per-position differences. Measured: exact 0.1289, estimate 0.1290, standard
    error 3.7e-4 (0.3 of one apart). Each position's estimate is noisier than the mean, which is why the card
    shows no per-token percentile."""
    import torch

    runner = TorchRunner.from_folder(smollm2_dir, threads=2)
    tokens = tokenize_text(smollm2_dir, WIKITEXT.read_text()[:40000], needed=4 * 513)[: 4 * 513].reshape(4, 513)
    rng = np.random.default_rng(0)
    estimates, exact = [], []
    for window in tokens:
        logits = np.asarray(runner.logits(window)[:-1], dtype=np.float32)
        noisy = logits + rng.normal(0, 0.6, logits.shape).astype(np.float32)
        ref = reference_window(logits, window, seed=1)
        estimates.append(compare_window(noisy, window, ref)["kld"])
        log_p = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
        log_q = torch.log_softmax(torch.from_numpy(noisy).double(), dim=-1)
        exact.append(torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).numpy())
    estimate, truth = np.concatenate(estimates), np.concatenate(exact)
    assert len(truth) == 2048
    standard_error = np.std(estimate - truth, ddof=1) / np.sqrt(len(truth))
    print(f"exact {truth.mean():.4f} estimate {estimate.mean():.4f} SE {standard_error:.2e}")
    assert abs(estimate.mean() - truth.mean()) < 3 * standard_error
    assert 0.02 < truth.mean() < 0.5  # a KL of the size the card reports for 4-bit files, not a trivial one


def test_non_finite_logits_stop_scoring_where_they_first_appear_but_a_masked_token_does_not(tiny_llama):
    """NaN or +inf in a window's logits (a broken artifact) stops scoring with the window and position; a -inf logit
    (a vocabulary entry the model masks out) leaves every figure finite and passes."""
    windows = np.stack([np.arange(100, 164, dtype=np.int32), np.arange(300, 364, dtype=np.int32)])
    runner = TorchRunner.from_folder(tiny_llama, threads=2)
    refs, _ = score_reference(runner.logits, windows)
    masked_entry = int(windows.max()) + 1  # no window's next token

    def masked(tokens):
        logits = runner.logits(tokens)
        logits[:, masked_entry] = -np.inf
        return logits

    assert np.isfinite(score_artifact(masked, windows, refs)["kld_mean"])

    def broken(tokens, value):
        logits = runner.logits(tokens)
        if tokens[0] == windows[1, 0]:
            logits[9, 7] = value  # position 10 of window 2
        return logits

    for value in (np.nan, np.inf):
        with pytest.raises(NonFiniteLogits, match=r"the artifact's negative log likelihood at window 2, position 10"):
            score_artifact(lambda tokens, value=value: broken(tokens, value), windows, refs)
    with pytest.raises(NonFiniteLogits, match=r"the reference's .* at window 2, position 10 is nan"):
        score_reference(lambda tokens: broken(tokens, np.nan), windows)


def test_scored_rows_are_grouped_alike_however_a_runner_cuts_them(monkeypatch):
    """Row chunks are the same rows whether the logits come whole or in blocks of any size (a chunk straddling two
    blocks is copied before the next block may overwrite the buffer); the unscored last position is dropped."""
    import quantforge.evaluate as evaluate

    monkeypatch.setattr(evaluate, "ROW_CHUNK", 4)
    logits = np.arange(23 * 3, dtype=np.float32).reshape(23, 3)  # 23 positions, 22 scored

    def grouped(source):
        return [(start, rows.copy()) for start, rows in evaluate._row_blocks(source, 22)]

    whole = grouped(logits)
    assert [len(rows) for _, rows in whole] == [4, 4, 4, 4, 4, 2]
    for cuts in ([1, 5, 6], [3], [4, 8, 12, 16, 20], [2, 3, 4, 21, 22], list(range(1, 23))):
        blocks = (block.copy() for block in np.split(logits, cuts))
        assert all(a == b and np.array_equal(x, y) for (a, x), (b, y) in zip(whole, grouped(blocks), strict=True))
    with pytest.raises(ValueError, match="20 positions, not the 22"):
        grouped(iter([logits[:20]]))


def test_a_block_of_logits_is_let_go_before_the_runner_makes_the_next(monkeypatch):
    """Neither the reference nor the comparison holds a block of logits (or a view of it) while the runner makes the
    next one: a torch runner's blocks are fresh arrays, and two of them alive at once cost 78 MB more at a 152k
    vocabulary (the first block used to live through the whole window). Figures match the whole logits'."""
    import weakref

    import quantforge.evaluate as evaluate

    monkeypatch.setattr(evaluate, "ROW_CHUNK", 4)
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (31, 50)).astype(np.float32)  # 30 scored rows: blocks of 8 leave a chunk straddling
    tokens = rng.integers(0, 50, 31).astype(np.int32)

    def runner_blocks(alive: list):
        for start in range(0, 30, 8):
            assert all(ref() is None for ref in alive), f"a block was still held when block {start // 8} was made"
            block = np.array(logits[start : min(start + 8, 30)])  # fresh, as a torch head's output is
            alive.append(weakref.ref(block))
            yield block
            del block

    alive: list = []
    ref = evaluate.reference_window(runner_blocks(alive), tokens, top_k=4, tail_samples=8)
    assert len(alive) == 4
    whole = evaluate.reference_window(logits, tokens, top_k=4, tail_samples=8)
    assert all(np.array_equal(getattr(ref, f), getattr(whole, f)) for f in evaluate.REFERENCE_FIELDS)
    alive = []
    compared = evaluate.compare_window(runner_blocks(alive), tokens, whole)
    assert len(alive) == 4
    expected = compare_window(logits, tokens, whole)
    assert all(np.array_equal(value, expected[key]) for key, value in compared.items())


def test_figures_do_not_depend_on_the_row_chunk_and_no_chunk_leaves_state_behind(monkeypatch, tiny_llama):
    """The reference's stored prediction and the comparison's figures are bit for bit the same whatever the row
    chunk (the chunk's buffers are reused: nothing may leak from one chunk or window into the next), and the NLL is
    the float64 log-softmax's."""
    import quantforge.evaluate as evaluate

    runner = TorchRunner.from_folder(tiny_llama, threads=2)
    windows = [np.arange(start, start + 64, dtype=np.int32) for start in (100, 900)]
    logits = [runner.logits(tokens) for tokens in windows]
    noise = np.random.default_rng(0).normal(0, 0.3, logits[0].shape).astype(np.float32)

    def figures(chunk: int):
        monkeypatch.setattr(evaluate, "ROW_CHUNK", chunk)
        refs = [
            reference_window(rows, tokens, seed=i) for i, (rows, tokens) in enumerate(zip(logits, windows, strict=True))
        ]
        compared = [
            compare_window(rows + noise, tokens, ref) for rows, tokens, ref in zip(logits, windows, refs, strict=True)
        ]
        return refs, compared

    refs, compared = figures(16)
    # Not chunks of one or two rows: torch then splits a wide row's max and sum differently (1e-7), as it always did.
    for chunk in (3, 5, 63):
        other_refs, other_compared = figures(chunk)
        for ref, other in zip(refs, other_refs, strict=True):
            assert all(np.array_equal(getattr(ref, f), getattr(other, f)) for f in evaluate.REFERENCE_FIELDS), chunk
        for one, other in zip(compared, other_compared, strict=True):
            assert all(np.array_equal(one[key], other[key]) for key in one), chunk
    wide = logits[1][:-1].astype(np.float64)
    peak = wide.max(axis=-1, keepdims=True)
    oracle = peak[:, 0] + np.log(np.exp(wide - peak).sum(axis=-1)) - wide[np.arange(63), windows[1][1:]]
    assert np.allclose(refs[1].nll, oracle, rtol=1e-12, atol=1e-12)
    assert np.array_equal(refs[1].top_ids[:, 0], wide.argmax(axis=-1))
    assert np.allclose(refs[1].tail_mass, 1 - np.exp(refs[1].top_logp.astype(np.float64)).sum(axis=-1), atol=1e-5)
    assert compared[1]["kld"].mean() > 1e-3


def test_second_half_scoring_keeps_the_default_runs_figures_at_those_positions(tiny_run, tiny_llama, tmp_path):
    """--ppl-scoring second-half scores llama-perplexity's positions: the reference's per-position figures are the
    default run's at the same positions (its head run on those alone), an artifact is compared at those alone,
    and the card names the convention."""
    run = build_run(tiny_llama, tmp_path / "half", "--formats", "gguf-q8_0", *FAST_EVAL, "--ppl-scoring", "second-half")
    context, windows = (int(FAST_EVAL[FAST_EVAL.index(flag) + 1]) for flag in ("--ppl-context", "--ppl-windows"))
    first = context // 2
    whole, half = np.load(tiny_run / "work" / "reference.npz"), np.load(run / "work" / "reference.npz")
    assert half["nll"].shape == (windows, context - 1 - first)
    np.testing.assert_allclose(half["nll"], whole["nll"][:, first:], rtol=1e-5, atol=1e-5)
    assert np.array_equal(half["top_ids"][..., 0], whole["top_ids"][:, first:, 0])
    stages = read_json(run / "run.json")["stages"]
    assert stages["reference"]["result"]["tokens_scored"] == windows * (context - 1 - first)
    q8 = stages["evaluate/gguf-q8_0"]["result"]
    assert q8["tokens_scored"] == windows * (context - 1 - first)
    assert 0 < q8["kld_mean"] < 0.01 and abs(q8["perplexity"] / stages["reference"]["result"]["perplexity"] - 1) < 0.01
    card = read_json(run / "card.json")["evaluation"]
    assert card["scoring"] == "second-half" and card["convention"].startswith("llama-perplexity's convention")
    assert read_json(tiny_run / "card.json")["evaluation"]["scoring"] == "all"
    assert "llama.cpp's own figures (llama-perplexity" in (run / "card.md").read_text()


RUNNING_PERPLEXITY = re.compile(r"\[(\d+)\](\d+\.\d+),")  # llama-perplexity's "[1]41.2345,[2]..."


def _llama_perplexity(gguf: Path, context: int, windows: int, *flags: str) -> list[float]:
    """llama-perplexity's running perplexity after each window of the text file, as it prints it."""
    from quantforge.backends.llamacpp.tools import require_tool

    command = [str(require_tool("llama-perplexity")), "-m", str(gguf), "-f", str(WIKITEXT), "-c", str(context)]
    command += ["-b", str(context), "--chunks", str(windows), "-t", "2", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return [float(value) for _, value in RUNNING_PERPLEXITY.findall(done.stdout + done.stderr)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "llama"])  # a tokenizer that adds BOS (Gemma's layout), one that does not
def test_second_half_scoring_equals_llama_perplexity_window_by_window(kind, tiny_model, tmp_path):
    """Issue 36: --ppl-scoring second-half is llama-perplexity's scoring, checked against llama.cpp's own program on
    the same F16 file and text file: its running perplexity after each window equals ours to the digits it prints.
    With BOS, llama-perplexity cuts BOS + text every ``context`` tokens and overwrites each cut's first token with
    BOS; quantforge once took ``context - 1`` fresh text tokens per window, so from the second window on it scored
    other tokens.

    Issue 37: the same file measured with a q8_0 KV cache (--kv-cache) is llama-perplexity's with
    ``-fa on -ctk q8_0 -ctv q8_0``, window by window too."""
    context, windows = 128, 4
    run = build_run(
        tiny_model(kind),
        tmp_path / "run",
        *("--formats", "gguf-f16", "--eval-text", str(WIKITEXT), "--ppl-scoring", "second-half"),
        *("--ppl-context", str(context), "--ppl-windows", str(windows), "--threads", "2", "--no-speed"),
        *("--kv-cache", "q8_0"),
    )
    card = read_json(run / "card.json")
    assert (card["evaluation"]["bos_token_id"] is not None) == (kind == "gemma3")
    [entry] = card["formats"]
    gguf = next((run / entry["artifact"]).glob("*.gguf"))
    for flags, sums in [
        (("-fa", "off"), entry["per_window"]),
        (
            ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
            read_json(run / "evals/kv-cache/gguf-f16/q8_0.json")["per_window"],
        ),
    ]:
        theirs = _llama_perplexity(gguf, context, windows, *flags)
        ours = np.exp(np.cumsum(sums["nll"]) / np.cumsum(sums["tokens"]))
        print(kind, flags, "quantforge", ours, "llama-perplexity", theirs)
        assert len(theirs) == windows and sums["tokens"] == [context - 1 - context // 2] * windows
        np.testing.assert_allclose(ours, theirs, rtol=1e-7, atol=6e-5)  # it prints four decimals
    assert entry["kv_cache"]["q8_0"]["flash_attn"] is True


def test_a_runner_without_a_first_position_still_scores_the_second_half(tiny_llama):
    """A plugin's runner written before ``scored_logits`` took ``first`` gets its leading rows dropped, wherever its
    blocks are cut."""
    from quantforge.evaluate import scored_logit_blocks

    class OldRunner:
        def __init__(self, runner):
            self.runner = runner

        def scored_logits(self, tokens):
            rows = self.runner.logits(tokens)[:-1]
            return iter(np.array_split(rows, 5))  # blocks of 13 rows: the cut falls inside one

    runner = TorchRunner.from_folder(tiny_llama, threads=2)
    tokens = np.arange(100, 164, dtype=np.int32)
    kept = np.concatenate(list(scored_logit_blocks(OldRunner(runner), tokens, first=32)))
    assert np.array_equal(kept, runner.logits(tokens)[32:-1])
    every = np.concatenate(list(scored_logit_blocks(OldRunner(runner), tokens)))
    assert np.array_equal(every, runner.logits(tokens)[:-1]) and np.array_equal(every[32:], kept)


def test_an_unknown_scoring_convention_is_one_line_naming_the_choices(tiny_llama, tmp_path):
    result = quantforge_cli("build", str(tiny_llama), "--out", str(tmp_path / "run"), "--ppl-scoring", "half")
    assert result.returncode != 0
    assert "Invalid value for '--ppl-scoring': 'half' is not one of 'all', 'second-half'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "formats, kv_cache, line",
    [
        ("gguf-q8_0", "q9_0", "unknown --kv-cache type 'q9_0': use q8_0, q4_0"),
        ("int8", "q8_0", "--kv-cache q8_0: none of the formats asked runs where quantforge can quantize the KV cache"),
    ],
)
def test_a_kv_cache_no_format_offers_is_one_line_before_any_work(formats, kv_cache, line, tiny_llama, tmp_path):
    run = tmp_path / "run"
    result = quantforge_cli("build", str(tiny_llama), "--out", str(run), "--formats", formats, "--kv-cache", kv_cache)
    assert result.returncode == 2 and line in result.stderr
    assert "Traceback" not in result.stderr and not run.exists()


def test_tokenizing_a_prefix_gives_the_whole_texts_first_tokens(smollm2_dir):
    text = WIKITEXT.read_text()
    whole = tokenize_text(smollm2_dir, text)
    for needed in (128, 8192, 60_000):
        prefix = tokenize_text(smollm2_dir, text, needed)
        assert len(prefix) == needed and np.array_equal(prefix, whole[:needed]), needed
    # Asked for more than the text holds: all of it, so the window check can say how much there was.
    assert np.array_equal(tokenize_text(smollm2_dir, text, len(whole) + 1), whole)


def test_task_accuracies_and_recovery(tiny_run):
    card = read_json(tiny_run / "card.json")
    reference = card["reference"]["tasks"]
    assert set(reference) == {"arc_easy", "winogrande", "lambada"}
    for entry in card["formats"]:
        for name, task in entry["tasks"].items():
            assert 0.0 <= task["value"] <= 1.0
            assert task["samples"] == reference[name]["samples"] == 12  # recovery on the same examples
            if reference[name]["value"]:
                assert task["recovery_pct"] == pytest.approx(100 * task["value"] / reference[name]["value"])
    assert "## Task accuracy" in (tiny_run / "card.md").read_text()


def test_llama_cpp_and_transformers_agree_on_task_log_likelihoods(tiny_run, tiny_llama):
    """The F16 GGUF in llama.cpp and the reference in transformers score the same task requests alike, request by
    request: GGUF task figures then differ from the reference's only through quantization. Every answer is the
    same wherever the reference's best choice leads the next by more than float16 rounding could move it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from quantforge.backends.llamacpp import LlamaCppRunner
    from quantforge.tasks import make_runner_lm

    docs = [json.loads(line) for line in (TASKS_DATA / "arc_easy.jsonl").read_text().splitlines()[:12]]
    requests = [SimpleNamespace(args=(f"{d['query']}\nAnswer:", f" {c}")) for d in docs for c in d["choices"]]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    reference_runner = TorchRunner.from_folder(tiny_llama, threads=2)
    f16_runner = LlamaCppRunner(next((tiny_run / "artifacts" / "gguf-f16").glob("*.gguf")), context=256, threads=2)
    try:
        reference = [ll for ll, _ in make_runner_lm(reference_runner, tokenizer, 256).loglikelihood(requests)]
        f16 = [ll for ll, _ in make_runner_lm(f16_runner, tokenizer, 256).loglikelihood(requests)]
    finally:
        f16_runner.close()
    np.testing.assert_allclose(f16, reference, atol=0.02)  # nats per continuation: float16 weights' rounding
    start = 0
    for doc in docs:
        count = len(doc["choices"])
        ours, theirs = np.asarray(f16[start : start + count]), np.asarray(reference[start : start + count])
        start += count
        margin = np.sort(theirs)[-1] - np.sort(theirs)[-2]
        if margin > 0.05:
            assert ours.argmax() == theirs.argmax(), doc["query"]
    # and the stored accuracies are those of these very requests
    card = read_json(tiny_run / "card.json")
    offsets = np.cumsum([0] + [len(d["choices"]) for d in docs])

    def accuracy(lls):
        return np.mean([np.argmax(lls[a:b]) == d["gold"] for a, b, d in zip(offsets, offsets[1:], docs, strict=False)])

    assert card["reference"]["tasks"]["arc_easy"]["value"] == pytest.approx(accuracy(reference))
    f16_entry = next(e for e in card["formats"] if e["key"] == "gguf-f16")
    assert f16_entry["tasks"]["arc_easy"]["value"] == pytest.approx(accuracy(f16))


def test_speed_probe_and_roofline(tiny_run):
    card = read_json(tiny_run / "card.json")
    speeds = {"reference": card["reference"]["speed"], **{e["key"]: e["speed"] for e in card["formats"]}}
    for key, speed in speeds.items():
        assert speed["measured"], key
        assert speed["runtime"] == ("transformers" if key == "reference" else "llama.cpp")
        assert speed["prompt_tps"] > 0 and speed["decode_tps"] > 0 and speed["ttft_s"] > 0
        # the first token comes after the whole prompt was processed, and after at least one decode step's worth
        assert speed["ttft_s"] >= speed["prompt_tokens"] / speed["prompt_tps"] * 0.99
        assert speed["ttft_s"] < speed["prompt_tokens"] / speed["prompt_tps"] + 10 * speed["tpot_s"]
        assert speed["peak_rss_mb"] > 50
        # Decoding cannot beat reading every weight once per token at the measured bandwidth (of the CPU: the build's
        # device, where every runtime ran).
        assert speed["device"] == "cpu" and speed["decode_tps_bound"] == speed["host_decode_tps_bound"]
        assert speed["host_decode_tps_bound"] > speed["decode_tps"]
        assert 0 < speed["fraction_of_roofline"] < 1
        assert speed["gpus"]["H100"]["computed"] and speed["gpus"]["H100"]["decode_tps_bound"] > speed["decode_tps"]
        assert speed["omp_wait_policy"] == "PASSIVE", key  # the tests' own choice (conftest) is the user's: kept
    assert card["host"]["bandwidth_gbs"] > 0.5
    assert "## Decode speed" in (tiny_run / "card.md").read_text()
    assert "(OpenMP wait policy: PASSIVE)" in (tiny_run / "card.md").read_text()


def test_a_probe_on_a_gpu_is_set_beside_that_gpus_roofline_not_the_hosts():
    """The bound is the device's the probe ran on: a GPU's published bandwidth, found by the name CUDA gives it;
    none for a GPU the table lacks, rather than a fraction against the host's memory."""
    from quantforge.gpus import GPUS, device_roofline, published_bandwidth, roofline

    weights = 4 * 10**9
    speed = {"decode_tps": 400.0, "host_decode_tps_bound": 5.0}
    on_h100 = device_roofline("cuda:1", weights, speed, device_name="NVIDIA H100 80GB HBM3")
    assert on_h100["decode_tps_bound"] == roofline(weights, GPUS["H100"][1])
    assert on_h100["fraction_of_roofline"] == pytest.approx(400 / on_h100["decode_tps_bound"])
    assert on_h100["device"] == "cuda:1" and on_h100["device_name"] == "NVIDIA H100 80GB HBM3"
    assert published_bandwidth("NVIDIA GeForce RTX 4090")[0] == "RTX 4090"
    assert published_bandwidth("NVIDIA H100 PCIe")[0] == "H100 PCIe"  # the longer name first
    unknown = device_roofline("cuda:0", weights, speed, device_name="Tesla V100-SXM2-32GB")
    assert unknown["decode_tps_bound"] is None and unknown["fraction_of_roofline"] is None
    on_cpu = device_roofline("cpu", weights, {"decode_tps": 2.0, "host_decode_tps_bound": 5.0})
    assert on_cpu["decode_tps_bound"] == 5.0 and on_cpu["fraction_of_roofline"] == 0.4


def test_llama_cpp_is_put_on_the_chosen_gpu_alone():
    """--device cuda:N: llama.cpp's default would spread the layers over every visible GPU; vLLM, which takes the
    first GPU it sees, is shown that one alone."""
    from quantforge.device import llama_gpu_params, llama_tool_gpu_args, visible_devices_for

    assert llama_gpu_params("cuda:1", offloads=True) == {"n_gpu_layers": -1, "split_mode": 0, "main_gpu": 1}
    assert llama_gpu_params("cuda:1", offloads=False) == {"n_gpu_layers": 0}  # a llama.cpp built for the CPU
    assert llama_gpu_params("cpu", offloads=True) == {"n_gpu_layers": 0}
    assert llama_tool_gpu_args("cuda:2") == ["-ngl", "999", "-sm", "none", "-mg", "2"]
    assert llama_tool_gpu_args("cpu") == []
    assert visible_devices_for("cuda:1", {}) == "1"
    assert visible_devices_for("cuda:1", {"CUDA_VISIBLE_DEVICES": "4, 6"}) == "6"
    assert visible_devices_for("cpu", {}) is None


def test_the_speed_probe_runs_as_users_run_the_runtime_not_with_our_short_spin(tiny_run, tmp_path):
    """A build makes OpenMP threads spin only briefly when the user set no policy; a probe that inherited that would
    not time llama.cpp as its users run it (openmp.py). So the probe gets the user's
    environment, the figure says which policy it ran under, and a change of policy redoes the speed stages alone."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = read_json(run / "run.json")["stages"]
    result = quantforge_cli(
        "build", before["fetch"]["result"]["path"], "--out", str(run), *TINY_RUN_ARGS, env={"OMP_WAIT_POLICY": None}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    after = read_json(run / "run.json")["stages"]
    card = read_json(run / "card.json")
    speeds = {"reference": card["reference"]["speed"], **{e["key"]: e["speed"] for e in card["formats"]}}
    for key, speed in speeds.items():
        assert speed["measured"] and speed["omp_wait_policy"] == "default", key
        assert after[f"speed/{key}"]["started"] != before[f"speed/{key}"]["started"], key
        assert after[f"speed/{key}"]["settings"]["omp_wait_policy"] == "default"
    for key in ("reference", *(f"evaluate/{e['key']}" for e in card["formats"])):
        assert after[key]["started"] == before[key]["started"], f"{key} was redone"
    assert "(OpenMP wait policy: default)" in (run / "card.md").read_text()


def test_our_short_spin_stays_ours(monkeypatch):
    from quantforge.openmp import OURS, SPIN_COUNT, WAIT_POLICY, users_environment, wait_briefly, wait_policy

    for name in (WAIT_POLICY, SPIN_COUNT, OURS):
        monkeypatch.delenv(name, raising=False)
    wait_briefly()
    assert wait_policy() == "default, GOMP_SPINCOUNT=1000"  # this process's threads spin briefly, then sleep
    assert SPIN_COUNT not in users_environment() and OURS not in users_environment()
    assert wait_policy(users_environment()) == "default"
    # A policy or a spin count the user set is theirs: kept in this process and in the probe's.
    for name, value in ((WAIT_POLICY, "ACTIVE"), (SPIN_COUNT, "50")):
        for other in (WAIT_POLICY, SPIN_COUNT, OURS):
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(name, value)
        wait_briefly()
        assert os.environ.get(SPIN_COUNT) in (None, "50") and OURS not in os.environ
        assert users_environment()[name] == value and wait_policy(users_environment()) == wait_policy()


def test_probe_memory_is_the_probes_own_not_its_parents(tiny_run, tmp_path):
    """Linux carries ru_maxrss across fork and exec: started from a process holding 1.5 GB, the probe must still
    report its own peak, a small model's."""
    held = np.ones(1536 * 2**20 // 8)  # written, so resident
    gguf = next((tiny_run / "artifacts" / "gguf-q8_0").glob("*.gguf"))
    prompt = tmp_path / "prompt.npy"
    np.save(prompt, np.arange(100, 116, dtype=np.int32))
    command = [sys.executable, "-m", "quantforge.probe_process", "--runtime", "llama.cpp", "--path", str(gguf)]
    command += ["--prompt", str(prompt), "--gen-tokens", "4", "--threads", "2", "--runs", "1"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    assert held[-1] == 1.0 and 20 < peak < 1000, peak


def test_unknown_task_is_a_clear_error(tiny_llama, tmp_path):
    result = quantforge_cli(
        "build",
        str(tiny_llama),
        "--formats",
        "gguf-q8_0",
        "--tasks",
        "mmlu_pro",
        "--tasks-data",
        str(TASKS_DATA),
        "--out",
        str(tmp_path / "r"),
        *FAST_EVAL,
    )
    assert result.returncode == 2
    assert (
        "error: unknown task 'mmlu_pro'; known tasks: arc_easy, gsm8k, hellaswag, lambada, piqa, winogrande"
        in result.stderr
    )


def test_tasks_without_data_say_which_option_to_use(tiny_llama, tmp_path):
    result = quantforge_cli(
        "build",
        str(tiny_llama),
        "--formats",
        "gguf-q8_0",
        "--tasks",
        "arc_easy",
        "--out",
        str(tmp_path / "r"),
        *FAST_EVAL,
    )
    assert result.returncode == 2 and "--tasks-data DIR" in result.stderr


def test_malformed_task_file_names_the_row(tiny_llama, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [json.loads(line) for line in (TASKS_DATA / "arc_easy.jsonl").read_text().splitlines()[:5]]
    del rows[3]["gold"]
    (data / "arc_easy.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = quantforge_cli(
        "build",
        str(tiny_llama),
        "--formats",
        "gguf-q8_0",
        "--tasks",
        "arc_easy",
        "--tasks-data",
        str(data),
        "--out",
        str(tmp_path / "r"),
        *FAST_EVAL,
    )
    assert result.returncode == 2
    assert f"{data / 'arc_easy.jsonl'}:4 lacks the field 'gold'" in result.stderr


def test_finished_evaluations_survive_a_failed_task_stage(tiny_run, tmp_path):
    """A later failure (here: a task whose data went missing) leaves every finished evaluation recorded."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = read_json(run / "run.json")["stages"]
    data = tmp_path / "data"
    shutil.copytree(TASKS_DATA, data)
    (data / "piqa_valid.jsonl").write_text('{"goal": "x"}\n')
    result = quantforge_cli(
        "build",
        before["fetch"]["result"]["path"],
        "--formats",
        "gguf-q8_0",
        "--out",
        str(run),
        *FAST_EVAL,
        "--tasks",
        "piqa",
        "--tasks-data",
        str(data),
    )
    assert result.returncode == 2 and "lacks the field 'sol1'" in result.stderr
    after = read_json(run / "run.json")["stages"]
    assert after == before
