"""gguf-auto (issue 38): the searched per-tensor GGUF mix, on the tiny llama (256 wide: every K-quant applies).

One build, killed in the middle of its search and run again, serves every test: the resumed search, the target
met with its interval, the file smaller than the uniform types that meet it, and the file remade byte for byte by
llama-quantize alone from what the card says.

Measured (tiny llama, 8 windows of 128 tokens, --max-kld 0.05, 2 cores): the search makes 34 files in 105 s; the
chosen mix is 11.2 MB at KL 0.0459 [0.0439, 0.0479] (q6_k attn_k and attn_v, q5_k attn_q, attn_output and the
embedding); the uniform imatrix files: Q6_K 13.1 MB at 0.0092, Q5_K_M 12.9 MB at 0.0222, Q4_K_M 12.8 MB at
0.0776, Q3_K_M 12.7 MB at 0.2034.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CALIBRATION, WIKITEXT, build_run, read_json

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gguf-auto")]

MAX_KLD = 0.05
UNIFORM = ("gguf-q6k", "gguf-q5km", "gguf-q4km", "gguf-q3km")
ARGS = [
    *("--formats", ",".join([*UNIFORM, "gguf-auto"]), "--backend", "imatrix,ggufauto"),
    *("--eval-text", str(WIKITEXT), "--ppl-context", "128", "--ppl-windows", "8", "--threads", "2", "--no-speed"),
    *CALIBRATION,
    *("--max-kld", str(MAX_KLD)),
]
KILL_AFTER = 6  # candidates measured before the build is killed


def _quantize_runs(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.startswith("$ ") and "llama-quantize" in line)


@pytest.fixture(scope="module")
def resumed_run(tiny_llama, tmp_path_factory):
    """The build killed (SIGKILL, the whole process group) once its search has measured KILL_AFTER candidates,
    then run again to the end. Returns (run, candidates kept at the kill, llama-quantize runs after it)."""
    run = tmp_path_factory.mktemp("auto") / "run"
    candidates = None
    command = [sys.executable, "-m", "quantforge.cli", "build", str(tiny_llama), "--out", str(run), *ARGS]
    build = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and build.poll() is None:
        candidates = next((run / "work" / "search").glob("gguf-auto-*/candidates.json"), None)
        if candidates and len(json.loads(candidates.read_text() or "{}")) >= KILL_AFTER:
            break
        time.sleep(0.2)
    assert build.poll() is None, "the build ended before its search had measured enough candidates to be killed"
    os.killpg(build.pid, signal.SIGKILL)
    build.wait()
    kept = json.loads(candidates.read_text())
    log = run / "logs" / "gguf-auto-search.log"
    before = _quantize_runs(log)
    build_run(tiny_llama, run, *ARGS)
    return run, kept, _quantize_runs(log) - before


def _auto(run: Path) -> dict:
    return next(e for e in read_json(run / "card.json")["formats"] if e["key"] == "gguf-auto")


def test_a_killed_search_resumes_where_it_stopped(resumed_run):
    run, kept, runs_after = resumed_run
    search = _auto(run)["quantize"]["search"]
    final = {f"{c['mix']}@{c['windows']}": c for c in search["candidates"]}
    assert len(kept) >= KILL_AFTER and all(final[key] == value for key, value in kept.items())
    # after the kill: each candidate not yet kept, and the chosen file itself, once
    assert runs_after == len(final) - len(kept) + 1


def test_the_mix_meets_its_target_with_its_interval_and_is_smaller_than_the_uniform_types_that_do(resumed_run):
    run, _, _ = resumed_run
    entries = {e["key"]: e for e in read_json(run / "card.json")["formats"]}
    auto = entries["gguf-auto"]
    assert auto["complete"] and auto["intervals"]["kld_mean"]["high"] <= MAX_KLD
    assert auto["quantize"]["search"]["confirmed"][-1]["kld_mean"] == auto["metrics"]["kld_mean"]
    meeting = [
        key for key, e in entries.items() if key != "gguf-auto" and e["intervals"]["kld_mean"]["high"] <= MAX_KLD
    ]
    assert meeting, "no uniform type meets the target: choose a looser MAX_KLD for this comparison"
    assert all(auto["size_bytes"] < entries[key]["size_bytes"] for key in meeting)
    # the uniform types that miss it are Q4_K_M and Q3_K_M (measured 0.0776 and 0.2034), both larger than the mix
    assert sorted(set(entries) - set(meeting) - {"gguf-auto"}) == ["gguf-q3km@imatrix", "gguf-q4km@imatrix"]
    text = (run / "card.md").read_text()
    assert "## gguf-auto: the searched mix" in text and (run / "card-search.png").stat().st_size > 10_000


def test_llama_quantize_alone_remakes_the_file_byte_for_byte_from_the_card(resumed_run, tmp_path):
    """The card's command, run in the run's work/ folder with the artifact's tensor-type file: the same bytes."""
    from quantforge.backends.llamacpp.tools import require_tool

    run, _, _ = resumed_run
    facts = _auto(run)["quantize"]
    artifact = run / _auto(run)["artifact"]
    work = run / "work"
    (work / facts["tensor_type_file"]).write_bytes((artifact / facts["tensor_type_file"]).read_bytes())
    command = shlex.split(facts["reproduce"])
    assert command[0] == "llama-quantize"
    made = tmp_path / command[-2]
    command = [str(require_tool("llama-quantize")), *command[1:-2], str(made), command[-1]]
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    original = next(artifact.glob("*.gguf"))
    assert made.read_bytes() == original.read_bytes()


def test_a_target_no_mix_meets_is_one_line_naming_the_closest_and_reuses_the_measurements(
    resumed_run, tiny_llama, tmp_path
):
    """A second build of the run for a tighter target searches again from the kept measurements (only its
    confirmations are new files), and when no mix meets the target, says so in one line with the closest."""
    import shutil

    from conftest import quantforge_cli

    run = tmp_path / "run"
    shutil.copytree(resumed_run[0], run)
    log = run / "logs" / "gguf-auto-search.log"
    before = _quantize_runs(log)
    args = [*ARGS[: ARGS.index("--max-kld")], "--max-kld", "0.0001"]
    result = quantforge_cli("build", str(tiny_llama), "--out", str(run), *args)
    assert result.returncode != 0
    said = "gguf-auto: no per-tensor mix met --max-kld 0.0001 with its 95% interval"
    line = next((line for line in result.stderr.splitlines() if said in line), None)
    assert line and "Traceback" not in result.stderr, result.stderr[-3000:]
    print(line)
    assert _quantize_runs(log) - before <= 4  # the confirmations at most: no candidate measured again
