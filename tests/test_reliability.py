"""Reliability: kills, interrupts, full and read-only disks, damaged files, and fuzzed inputs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    FAST_EVAL,
    RUN_TO_RUN_REL,
    TINY_RUN_ARGS,
    WIKITEXT,
    quantforge_cli,
    read_json,
    tree_digest,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantforge.errors import QuantforgeError
from quantforge.fsutil import PARTIAL_MARKER, file_records, find_partials

pytestmark = pytest.mark.reliability


def _build_command(model: Path, run: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "quantforge.cli", "build", str(model), "--out", str(run), *args]


def _wait_for(predicate, process, timeout=300.0) -> bool:
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.slow
def test_sigint_during_quantization_stops_cleanly_and_resumes(tiny_llama, tmp_path):
    run = tmp_path / "run"
    args = ["--formats", "gptq-int4", *FAST_EVAL, "--calib-samples", "8", "--calib-seqlen", "128"]
    process = subprocess.Popen(
        _build_command(tiny_llama, run, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    partial = lambda: (
        (run / "artifacts").exists() and any(PARTIAL_MARKER in p.name for p in (run / "artifacts").iterdir())
    )
    assert _wait_for(partial, process), "quantization never started"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr[-2000:]
    assert "interrupted: finished stages are kept" in stderr
    assert not find_partials(run / "artifacts")
    assert not (run / ".quantforge.lock").exists()
    stages = read_json(run / "run.json")["stages"]
    assert "reference" in stages and "quantize/gptq-int4" not in stages
    result = quantforge_cli("build", str(tiny_llama), "--out", str(run), *args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_json(run / "run.json")["stages"]["reference"]["started"] == stages["reference"]["started"]


def test_layer_resume_mode_quantizes_and_leaves_no_local_path(tiny_llama, tmp_path):
    run = tmp_path / "run"
    result = quantforge_cli(
        "build",
        str(tiny_llama),
        "--out",
        str(run),
        "--formats",
        "gptq-int4",
        "--layer-resume",
        *FAST_EVAL,
        "--calib-samples",
        "8",
        "--calib-seqlen",
        "128",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    config = (run / "artifacts" / "gptq-int4" / "config.json").read_text()
    assert '"offload_to_disk": true' in config and str(run) not in config
    assert not any((run / "work" / "checkpoints").iterdir())  # layer checkpoints go once the artifact is done


@pytest.mark.slow
def test_evaluation_killed_half_way_resumes_at_the_window_where_it_stopped(tiny_llama, tiny_run, tmp_path):
    run = tmp_path / "run"
    args = [
        "--formats",
        "gguf-q8_0",
        "--eval-text",
        str(WIKITEXT),
        "--ppl-context",
        "128",
        "--ppl-windows",
        "40",
        "--threads",
        "2",
        "--no-speed",
    ]
    # Killed (SIGKILL) right after the reference's third window is saved: the same point on any machine.
    faults = str(Path(__file__).parent / "faults")
    kill = {
        "PYTHONPATH": faults,
        "QUANTFORGE_TEST_KILL_AFTER": "quantforge.evaluate:WindowProgress.add@quantforge.cli%3",
    }
    killed = quantforge_cli("build", str(tiny_llama), "--out", str(run), *args, env=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "reference" not in read_json(run / "run.json")["stages"]
    result = quantforge_cli("build", str(tiny_llama), "--out", str(run), *args)
    assert result.returncode == 0, result.stderr[-2000:]
    reference = read_json(run / "run.json")["stages"]["reference"]["result"]
    assert reference["resumed_windows"] == 3  # the three saved before the kill
    # The same windows computed in one go give the same figures.
    fresh = tmp_path / "fresh"
    assert quantforge_cli("build", str(tiny_llama), "--out", str(fresh), *args).returncode == 0
    again = read_json(fresh / "run.json")["stages"]["reference"]["result"]
    assert reference["perplexity"] == pytest.approx(again["perplexity"], rel=RUN_TO_RUN_REL)
    assert reference["tokens_scored"] == again["tokens_scored"]
    assert not list((run / "work" / "progress").glob("*.npz"))


def test_a_truncated_gguf_artifact_is_detected_and_rebuilt(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    gguf = next((run / "artifacts" / "gguf-q4km").glob("*.gguf"))
    original = file_records(gguf)
    gguf.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 3])
    model = read_json(run / "run.json")["stages"]["fetch"]["result"]["path"]
    result = quantforge_cli("build", model, "--out", str(run), *TINY_RUN_ARGS)
    assert result.returncode == 0, result.stderr[-2000:]
    assert file_records(gguf) == original


def test_damaged_gguf_is_a_clear_error(tiny_run, tmp_path):
    from quantforge.artifacts import gguf_tensors

    gguf = next((tiny_run / "artifacts" / "gguf-q8_0").glob("*.gguf"))
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(gguf.read_bytes()[:4096])
    with pytest.raises(QuantforgeError, match="damaged or truncated GGUF"):
        gguf_tensors(damaged)
    damaged.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(QuantforgeError, match="not a GGUF file"):
        gguf_tensors(damaged)


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:  # fail, not skip: a suite that passes without its disk tests would say too much
        pytest.fail(
            f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}): the full-disk and read-only tests "
            "need mount rights (root, as in CI); deselect them with -k 'not full_disk and not read_only' elsewhere"
        )


def test_full_disk_is_refused_up_front_with_the_numbers(tiny_llama, tmp_path):
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "8M")
    try:
        result = quantforge_cli(
            "build", str(tiny_llama), "--formats", "gguf-q8_0,gguf-q4km", "--out", str(disk / "run"), *FAST_EVAL
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert "not enough disk at" in result.stderr and "GB is free" in result.stderr
        assert not (disk / "run" / "artifacts").exists()
    finally:
        subprocess.run(["umount", str(disk)])


def test_read_only_run_directory(tiny_run, tmp_path):
    disk = tmp_path / "ro"
    _mount_tmpfs(disk, "256M")
    try:
        run = disk / "run"
        shutil.copytree(tiny_run, run)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        before = tree_digest(run)
        model = read_json(run / "run.json")["stages"]["fetch"]["result"]["path"]
        result = quantforge_cli("build", model, "--out", str(run), *TINY_RUN_ARGS)
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "read-only file system" in errors[0]
        assert tree_digest(run) == before
    finally:
        subprocess.run(["umount", str(disk)])


def test_leftovers_of_a_killed_run_are_reported_and_removed(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    leftover = run / "artifacts" / f"gguf-q4km{PARTIAL_MARKER}12345"
    leftover.mkdir()
    (leftover / "half.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    model = read_json(run / "run.json")["stages"]["fetch"]["result"]["path"]
    result = quantforge_cli("build", model, "--out", str(run), *TINY_RUN_ARGS)
    assert result.returncode == 0
    assert "removed 1 half-written file(s) left by an interrupted run" in result.stderr
    assert not leftover.exists()


def test_a_dropped_connection_resumes_the_download_with_a_range_request(tiny_llama, tmp_path):
    from hub_server import FakeHub

    # huggingface_hub reads 10 MB at a time: cut the connection after two such chunks have been written.
    with FakeHub({"acme/tiny-llama": tiny_llama}, drop_after_bytes=30_000_000) as hub:
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1", "HF_ENDPOINT": hub.endpoint}
        result = quantforge_cli(
            "build", "acme/tiny-llama", "--formats", "gguf-q8_0", "--out", str(tmp_path / "run"), *FAST_EVAL, env=env
        )
    assert result.returncode == 0, result.stderr[-2000:]
    assert any(r.startswith("bytes=") and r != "bytes=0-" for r in hub.ranges), hub.ranges
    weights = read_json(tmp_path / "run" / "card.json")["model"]["files"]["model.safetensors"]
    assert weights == file_records(tiny_llama / "model.safetensors")["model.safetensors"]


@pytest.mark.slow
def test_download_killed_half_way_completes_on_restart(tiny_llama, tiny_run, tmp_path):
    from hub_server import FakeHub

    import quantforge.source as source

    # A long read timeout: at huggingface_hub's default (10 s) a loaded host's client gave up on the held
    # connection and resumed with a Range request, which the server does not hold, so the download finished
    # before the kill (seen once with the suite in two processes).
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DOWNLOAD_TIMEOUT": "600"}
    run = tmp_path / "run"
    blobs = tmp_path / "hf" / "hub" / "models--acme--tiny-llama" / "blobs"
    args = ["--formats", "gguf-q4km", *FAST_EVAL]  # the artifact is what is compared; tasks and speed are not
    # The server holds the weights 15 MB in (huggingface_hub writes 10 MB at a time) until the build is killed.
    with FakeHub({"acme/tiny-llama": tiny_llama}, hold_after_bytes=15_000_000) as hub:
        env["HF_ENDPOINT"] = hub.endpoint
        process = subprocess.Popen(
            [sys.executable, "-m", "quantforge.cli", "build", "acme/tiny-llama", "--out", str(run), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Over 5 MB: only the held weights get there (the 3.5 MB tokenizer.json, also downloaded in parallel, was
        # once caught at 2 MB a moment before it completed, and the kill then left no partial file behind).
        half = lambda: (
            blobs.exists()
            and any(p.name.endswith(".incomplete") and p.stat().st_size > 5_000_000 for p in blobs.iterdir())
        )
        assert _wait_for(half, process, timeout=120)
        process.kill()
        process.wait()
        leftovers = list(blobs.glob("*.incomplete"))
        stale = time.time() - source.STALE_DOWNLOAD_SECONDS - 5
        for leftover in leftovers:
            os.utime(leftover, (stale, stale))  # as if the restart came a while later
        hub.release()
        result = subprocess.run(process.args, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"removed {len(leftovers)} partial download(s) of acme/tiny-llama" in result.stderr
    assert not list(blobs.glob("*.incomplete"))
    ours, theirs = (next((r / "artifacts" / "gguf-q4km").glob("*.gguf")) for r in (run, tiny_run))
    assert file_records(ours) == file_records(theirs)


def test_trust_remote_code_is_recorded_on_the_card(tiny_llama, tmp_path):
    result = quantforge_cli(
        "build",
        str(tiny_llama),
        "--formats",
        "gguf-q8_0",
        "--trust-remote-code",
        "--out",
        str(tmp_path / "run"),
        *FAST_EVAL,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_json(tmp_path / "run" / "card.json")["model"]["trust_remote_code"] is True
    assert "trust_remote_code was ON" in (tmp_path / "run" / "card.md").read_text()


def test_allowed_pickle_weights_are_converted(tiny_llama, tmp_path):
    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_llama, folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    result = quantforge_cli(
        "build",
        str(folder),
        "--formats",
        "gguf-q8_0",
        "--allow-pickle",
        "--out",
        str(tmp_path / "run"),
        *FAST_EVAL,
        env={"QUANTFORGE_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    card = read_json(tmp_path / "run" / "card.json")
    assert card["model"]["config"]["converted_from_pickle"]
    assert "pickle files" in (tmp_path / "run" / "card.md").read_text()


# ---------------------------------------------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.one_of(st.text(max_size=400).map(str.encode), st.binary(max_size=400)))
def test_fuzz_recipe_loader(tmp_path, data):
    """Any bytes, UTF-8 or not: a recipe or a one-line error, never a traceback."""
    from quantforge.recipes import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_bytes(data)
    try:
        load_recipe(path)
    except QuantforgeError:
        pass


YAML_LINES = [
    "model: bundled:smollm2-135m",
    "? [a, b]\n: 1",
    "? {k: v}\n: 2",
    "formats: [gguf-q4km]",
    "eval: {context: 64}",
    "eval: {[x]: 1}",
    "targets:\n  ? [max_kld]\n  : 1",
    "quantize: {group_size: 64}",
    "- a list item",
    "name: x",
]


@FUZZ
@given(st.lists(st.sampled_from(YAML_LINES), max_size=6))
def test_fuzz_recipe_keys_of_every_kind(tmp_path, lines):
    """Keys that are lists or mappings (YAML's complex keys), anywhere: one-line errors."""
    from quantforge.recipes import load_recipe
    from quantforge.release import load_release

    for loader, extra in ((load_recipe, ""), (load_release, "models:\n  - model: x\n")):
        path = tmp_path / "file.yaml"
        path.write_text("\n".join(lines) + "\n" + extra)
        try:
            loader(path)
        except QuantforgeError:
            pass


YAML_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3),
    max_leaves=10,
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["model", "formats", "eval", "targets", "quantize", "calibration", "name", "x"]),
        YAML_VALUES,
        max_size=5,
    )
)
def test_fuzz_recipe_structure(tmp_path, data):
    import yaml

    from quantforge.recipes import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        load_recipe(path)
    except QuantforgeError:
        pass


@FUZZ
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=2**64 - 1))
def test_fuzz_safetensors_header(tmp_path, body, length):
    from quantforge.artifacts import safetensors_header

    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", length % 400) + body)
    try:
        safetensors_header(path)
    except QuantforgeError:
        pass


@FUZZ
@given(
    st.dictionaries(
        st.text(max_size=8),
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(["F32", "F16", "I8", "Q4", 3]),
                "shape": st.lists(st.integers(min_value=-2, max_value=5), max_size=3),
                "data_offsets": st.lists(st.integers(min_value=-5, max_value=200), max_size=3),
            }
        ),
        max_size=4,
    ),
    st.integers(min_value=0, max_value=200),
)
def test_fuzz_safetensors_header_structure(tmp_path, header, padding):
    from quantforge.artifacts import safetensors_header

    raw = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * padding)
    try:
        safetensors_header(path)
    except QuantforgeError:
        pass


@pytest.fixture(scope="module")
def small_gguf(tiny_run) -> bytes:
    return next((tiny_run / "artifacts" / "gguf-q8_0").glob("*.gguf")).read_bytes()[:65536]


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_header(tmp_path, small_gguf, data):
    from quantforge.artifacts import gguf_tensors

    cut = data.draw(st.integers(min_value=0, max_value=len(small_gguf)))
    flips = data.draw(st.lists(st.tuples(st.integers(min_value=0, max_value=4095), st.integers(0, 255)), max_size=8))
    body = bytearray(small_gguf[:cut])
    for position, value in flips:
        if position < len(body):
            body[position] = value
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(body))
    try:
        gguf_tensors(path)
    except QuantforgeError:
        pass
