"""End-to-end builds of a tiny model through the real CLI: artifacts, card, resume."""

from __future__ import annotations

import json
import shutil

from conftest import TINY_FORMATS as FORMATS
from conftest import TINY_RUN_ARGS, quantforge_cli, read_json

from quantforge.fsutil import file_records


def test_build_writes_every_artifact_and_a_card(tiny_run):
    card = read_json(tiny_run / "card.json")
    keys = [entry["key"] for entry in card["formats"]]
    assert keys == FORMATS.split(",")
    for entry in card["formats"]:
        assert entry["complete"]
        artifact = tiny_run / entry["artifact"]
        ggufs = list(artifact.glob("*.gguf"))
        assert len(ggufs) == 1 and ggufs[0].stat().st_size == entry["size_bytes"]
    assert (tiny_run / "card.md").read_text().startswith("# quantforge card")
    assert card["decision"]["recommended"] in keys


def test_bits_per_weight_order_follows_the_schemes(tiny_run):
    bits = {e["key"]: e["bits_per_weight"] for e in read_json(tiny_run / "card.json")["formats"]}
    assert 15.5 < bits["gguf-f16"] <= 16.5
    assert 8.0 < bits["gguf-q8_0"] < 9.0
    assert 4.0 < bits["gguf-q4km"] < 6.5
    assert bits["gguf-f16"] > bits["gguf-q8_0"] > bits["gguf-q4km"]


def test_f16_reproduces_the_reference_and_error_grows_with_compression(tiny_run):
    card = read_json(tiny_run / "card.json")
    metrics = {e["key"]: e["metrics"] for e in card["formats"]}
    reference = card["reference"]["perplexity"]
    assert abs(metrics["gguf-f16"]["perplexity"] / reference - 1) < 0.001
    assert metrics["gguf-f16"]["kld_mean"] < metrics["gguf-q8_0"]["kld_mean"] < metrics["gguf-q4km"]["kld_mean"]
    assert metrics["gguf-q8_0"]["top1_agreement"] >= metrics["gguf-q4km"]["top1_agreement"]
    assert all(m["tokens_scored"] == card["reference"]["tokens_scored"] for m in metrics.values())


def test_each_gguf_loads_in_llama_cpp_and_generates(tiny_run):
    from llama_cpp import Llama

    for gguf in sorted((tiny_run / "artifacts").glob("*/*.gguf")):
        llm = Llama(str(gguf), n_ctx=64, n_threads=2, verbose=False)
        out = llm("The capital of France is", max_tokens=8, temperature=0)
        assert out["usage"]["completion_tokens"] > 0
        llm.close()


def test_manifest_records_inputs_outputs_and_timings(tiny_run):
    manifest = read_json(tiny_run / "run.json")
    stages = manifest["stages"]
    for key in ["fetch", "tokens", "reference", "intermediate/gguf-f16"] + [
        f"quantize/{f}" for f in FORMATS.split(",")
    ]:
        assert key in stages, key
        record = stages[key]
        assert record["input_digest"] and record["seconds"] >= 0 and record["host"]["cpus"]
        for rel, files in record["outputs"].items():
            now = file_records(tiny_run / rel)
            # Every recorded file is still there, byte for byte (the card later adds README.md/Modelfile beside them).
            assert {name: now[name] for name in files} == files
    assert stages["fetch"]["result"]["files"]["model.safetensors"]["sha256"]


def test_rerun_skips_every_finished_stage(tiny_run, tmp_path):
    run = tmp_path / "run"  # a copy: the shared run is read by the other test process meanwhile
    shutil.copytree(tiny_run, run)
    before = read_json(run / "run.json")["stages"]
    result = quantforge_cli("build", before["fetch"]["result"]["path"], "--out", str(run), *TINY_RUN_ARGS)
    assert result.returncode == 0, result.stderr
    assert "plan: every stage is done" in result.stderr  # said before the build would start any work
    after = read_json(run / "run.json")["stages"]
    for key, record in before.items():
        if key != "fetch":  # fetch is re-checked every time; it hashes nothing new
            assert after[key]["started"] == record["started"], f"{key} was redone"


def test_a_deleted_artifact_is_rebuilt_alone(tiny_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(tiny_run, run)
    before = read_json(run / "run.json")["stages"]
    q4 = next((run / "artifacts" / "gguf-q4km").glob("*.gguf"))
    q4.unlink()
    result = quantforge_cli("build", before["fetch"]["result"]["path"], "--out", str(run), *TINY_RUN_ARGS)
    assert result.returncode == 0, result.stderr
    assert "plan: every stage is done" in result.stderr  # said before the build would start any work
    after = read_json(run / "run.json")["stages"]
    assert after["quantize/gguf-q4km"]["started"] != before["quantize/gguf-q4km"]["started"]
    assert after["quantize/gguf-q8_0"]["started"] == before["quantize/gguf-q8_0"]["started"]
    assert after["quantize/gguf-q4km"]["outputs"] == before["quantize/gguf-q4km"]["outputs"]  # same bytes again
    # Its evaluations had the same inputs (same bytes), so they were not redone either.
    assert after["evaluate/gguf-q4km"]["started"] == before["evaluate/gguf-q4km"]["started"]


def test_card_command_re_decides_with_new_targets(tiny_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(tiny_run, run)
    strict = quantforge_cli("card", str(run), "--max-ppl-increase", "0", "--json")
    assert strict.returncode == 0, strict.stderr
    card = json.loads(strict.stdout)
    increase = {e["key"]: e["metrics"]["perplexity_increase_pct"] for e in card["formats"]}
    for verdict in card["decision"]["verdicts"]:
        met = verdict["outcome"] in ("recommended", "meets targets")
        assert met == (increase[verdict["key"]] <= 0), verdict
    loose = json.loads(
        quantforge_cli("card", str(run), "--max-ppl-increase", "1000", "--max-kld", "1", "--json").stdout
    )
    outcomes = {v["key"]: v["outcome"] for v in loose["decision"]["verdicts"]}
    # Everything passes a huge tolerance, so the least aggressive format wins and the rest are "more than needed".
    assert outcomes == {"gguf-f16": "recommended", "gguf-q8_0": "meets targets", "gguf-q4km": "meets targets"}
    # The stored card was rewritten with the new targets.
    assert read_json(run / "card.json")["targets"]["max_ppl_increase"] == 1000
