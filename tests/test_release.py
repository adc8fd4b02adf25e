"""Releases: two tiny models x formats, by the local executor and on a real local Ray cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import WIKITEXT, assert_same_results, quantforge_cli, read_json

from quantforge.fsutil import PARTIAL_MARKER, file_records


def write_release(path: Path, out: Path, models: list[dict]) -> Path:
    release = {
        "name": path.stem,
        "out": str(out),
        "defaults": {
            "formats": ["gguf-q8_0", "gguf-q4km"],
            "speed": False,
            "eval": {"text": str(WIKITEXT), "context": 128, "windows": 4, "threads": 1},
            "calibration": {"samples": 8, "seqlen": 128},
        },
        "models": models,
    }
    path.write_text(yaml.safe_dump(release, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_qwen2):
    return [
        {"model": str(tiny_llama), "formats": ["gguf-q8_0", "gptq-int4"]},
        {"model": str(tiny_qwen2), "formats": ["gguf-q8_0", "gguf-q5km"]},
    ]


@pytest.fixture(scope="module")
def local_release(models, tmp_path_factory):
    base = tmp_path_factory.mktemp("release-local")
    path = write_release(base / "release.yaml", base / "out", models)
    result = quantforge_cli("release", str(path), timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return path, base / "out"


@pytest.mark.slow
def test_local_release_writes_a_card_per_model(local_release):
    _, out = local_release
    for name in ("tiny-llama", "tiny-qwen2"):
        card = read_json(out / name / "card.json")
        assert card["decision"]["recommended"] is not None
    assert [e["key"] for e in read_json(out / "tiny-qwen2" / "card.json")["formats"]] == ["gguf-q8_0", "gguf-q5km"]


@pytest.mark.slow
def test_dry_run_lists_every_unit_and_what_is_done(local_release):
    path, _ = local_release
    result = quantforge_cli("release", str(path), "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    units = json.loads(result.stdout)["units"]
    assert len(units) == 2 * (2 + 2 * 2)
    assert all(u["done"] for u in units)
    quantize = next(u for u in units if u["unit"] == "tiny-llama/quantize/gptq-int4")
    assert quantize["depends"] == ["tiny-llama/prepare"] and quantize["resources"]["cpus"] == 1
    assert quantize["resources"]["memory_bytes"] > 0


@pytest.mark.slow
def test_rerun_redoes_nothing(local_release):
    path, out = local_release
    before = {name: read_json(out / name / "run.json")["stages"] for name in ("tiny-llama", "tiny-qwen2")}
    result = quantforge_cli("release", str(path), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    statuses = {o["status"] for o in json.loads(result.stdout)["outcomes"]}
    assert statuses == {"skipped (done earlier)"}
    for name, stages in before.items():
        after = read_json(out / name / "run.json")["stages"]
        assert {k: v["started"] for k, v in after.items() if k != "fetch"} == {
            k: v["started"] for k, v in stages.items() if k != "fetch"
        }


@pytest.mark.slow
def test_one_failing_model_does_not_stop_the_others(tiny_llama, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    path = write_release(
        tmp_path / "release.yaml",
        tmp_path / "out",
        [{"model": str(broken)}, {"model": str(tiny_llama), "formats": ["gguf-q8_0"]}],
    )
    result = quantforge_cli("release", str(path))
    assert result.returncode == 3  # errors.EXIT_FORMATS_FAILED
    assert "failed: broken/prepare:" in result.stderr and "is not a causal LM" in result.stderr
    assert "(retry: quantforge build" in result.stderr
    assert "tiny-llama: recommended gguf-q8_0" in result.stdout
    assert (tmp_path / "out" / "tiny-llama" / "card.json").exists()


def test_malformed_release_file_names_file_line_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmodels:\n  - model: a/b\n    formatz: [gguf-q8_0]\n")
    result = quantforge_cli("release", str(path), "--dry-run")
    assert result.returncode == 2
    assert f"{path}:4: unknown key 'models[0].formatz'" in result.stderr


@pytest.mark.slow
def test_ray_release_survives_a_killed_worker_and_equals_the_local_one(models, local_release, tmp_path):
    pytest.importorskip("ray")
    path = write_release(tmp_path / "release.yaml", tmp_path / "out", models)
    run = tmp_path / "out" / "tiny-llama"
    process = subprocess.Popen(
        [sys.executable, "-m", "quantforge.cli", "release", str(path), "--executor", "ray", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = None
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline and killed is None:
        artifacts = run / "artifacts"
        if artifacts.exists() and any(p.name.startswith("gptq-int4" + PARTIAL_MARKER) for p in artifacts.iterdir()):
            killed = int((run / ".quantforge.lock").read_text())
            os.kill(killed, signal.SIGKILL)  # the Ray worker running the quantize task
        time.sleep(0.005)
    stdout, stderr = process.communicate(timeout=900)
    assert killed is not None, "the quantize task finished before the worker could be killed"
    assert process.returncode == 0, stderr[-3000:]
    # Ray's raylet reports the dead worker and the retry on the driver's stdout, before our JSON.
    assert "will be retried" in stdout, stdout[:2000]
    outcomes = {o["unit"]: o["status"] for o in json.loads(stdout[stdout.index("\n{") + 1 :])["outcomes"]}
    assert outcomes["tiny-llama/quantize/gptq-int4"] == "done"  # retried on another worker after the kill
    _, local_out = local_release
    for name in ("tiny-llama", "tiny-qwen2"):
        ours, theirs = read_json(tmp_path / "out" / name / "card.json"), read_json(local_out / name / "card.json")
        assert_same_results(ours, theirs)
        for entry in ours["formats"]:
            key = entry["key"]
            assert (
                file_records(
                    tmp_path
                    / "out"
                    / name
                    / "artifacts"
                    / key
                    / next((tmp_path / "out" / name / "artifacts" / key).glob("*.*")).name
                )
                is not None
            )
            weights = (
                "model.safetensors"
                if key.startswith("gptq")
                else next((local_out / name / "artifacts" / key).glob("*.gguf")).name
            )
            assert file_records(tmp_path / "out" / name / "artifacts" / key / weights) == file_records(
                local_out / name / "artifacts" / key / weights
            ), (name, key)


def test_every_release_setting_reaches_the_build_request(tmp_path):
    from quantforge.release import build_request, load_release

    path = tmp_path / "release.yaml"
    path.write_text(
        "defaults:\n  revision: v2\n  quantize: {layer_resume: true, group_size: 64, act_order: true}\n"
        "models:\n  - model: acme/one\n  - model: acme/two\n    revision: main\n"
    )
    release = load_release(path)
    one, two = (build_request(release, model) for model in release.models)
    assert (one.revision, two.revision) == ("v2", "main")
    assert (one.layer_resume, one.group_size, one.act_order) == (True, 64, True)
