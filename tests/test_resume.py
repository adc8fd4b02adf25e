"""A real `quantforge build` killed with SIGKILL at several points resumes to the same artifacts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST_EVAL, TINY_FORMATS, TINY_RUN_ARGS, assert_same_results, quantforge_cli, read_json

from quantforge.fsutil import PARTIAL_MARKER, file_records, find_partials

pytestmark = pytest.mark.reliability


def _stages(run: Path) -> dict:
    try:
        return json.loads((run / "run.json").read_text())["stages"]
    except (OSError, json.JSONDecodeError, KeyError):
        return {}


def _kill_when(command: list[str], run: Path, ready, timeout: float = 300) -> bool:
    """Start the build and SIGKILL it as soon as ``ready(run)`` holds; False if it finished first."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if ready(run):
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            return True
        time.sleep(0.005)
    process.wait()
    return False


@pytest.mark.slow
def test_sigkill_at_several_points_then_resume(tiny_llama, tiny_run, tmp_path):
    run = tmp_path / "killed"
    command = [sys.executable, "-m", "quantforge.cli", "build", str(tiny_llama), "--out", str(run), *TINY_RUN_ARGS]
    triggers = [
        lambda r: "tokens" in _stages(r),  # during the reference evaluation
        lambda r: (
            any(PARTIAL_MARKER in p.name for p in (r / "artifacts").glob("*")) if (r / "artifacts").exists() else False
        ),  # while an artifact is half-written
        lambda r: "quantize/gguf-q8_0" in _stages(r),  # between quantization and evaluation
    ]
    kills = 0
    for trigger in triggers:
        before = _stages(run)
        kills += _kill_when(command, run, trigger)
        after = _stages(run)
        for key, record in before.items():  # what was finished before this attempt was not redone by it
            if key != "fetch" and key in after:
                assert after[key]["started"] == record["started"], key
    assert kills >= 2, "the build finished before it could be killed; the test proves nothing"

    result = quantforge_cli(*command[3:])
    assert result.returncode == 0, result.stderr
    assert not find_partials(run)
    ours, reference = read_json(run / "card.json"), read_json(tiny_run / "card.json")
    for key in TINY_FORMATS.split(","):
        # The model files byte for byte; README.md prints the measurements, compared below.
        ours_files, their_files = (file_records(r / "artifacts" / key) for r in (run, tiny_run))
        ours_files.pop("README.md"), their_files.pop("README.md")
        assert ours_files == their_files, key

    assert_same_results(ours, reference)
    assert [e["tasks"] for e in ours["formats"]] == [e["tasks"] for e in reference["formats"]]


def test_a_second_build_into_the_same_directory_is_refused(tiny_llama, tmp_path):
    run = tmp_path / "locked"
    command = [
        sys.executable,
        "-m",
        "quantforge.cli",
        "build",
        str(tiny_llama),
        "--formats",
        "gguf-q8_0",
        "--out",
        str(run),
        *FAST_EVAL,
    ]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (run / ".quantforge.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        second = quantforge_cli(*command[3:])
        assert second.returncode == 2
        assert f"in use by another quantforge run (pid {first.pid})" in second.stderr
    finally:
        first.wait()
    assert first.returncode == 0


def test_a_stale_lock_is_taken_over(tiny_llama, tmp_path):
    run = tmp_path / "stale"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / ".quantforge.lock").write_text(f"{dead.pid}\n")
    result = quantforge_cli("build", str(tiny_llama), "--formats", "gguf-q8_0", "--out", str(run), *FAST_EVAL)
    assert result.returncode == 0, result.stderr
    assert f"took over the lock of a run that is no longer alive (pid {dead.pid})" in result.stderr
    assert not (run / ".quantforge.lock").exists()
