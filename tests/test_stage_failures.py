"""No stage ends a build with a traceback: a library failing in a stage every format shares is one line naming the
stage, the library and its version, the exception's last line and the log that holds the traceback.

Exit 2 where nothing could be measured (tokens, reference: nothing is quantized), exit 3 where the run still says
something (the reference's speed probe, the calibration set, the card). Each test runs a real build of the tiny
llama; one library function is made to raise in one process (tests/faults/sitecustomize.py), as a library bug or a
broken install would, and everything else runs as usual.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FAST_EVAL, WIKITEXT, quantforge_cli, read_json

from quantforge.errors import EXIT_BAD_INPUT, EXIT_FORMATS_FAILED

FAULTS = Path(__file__).parent / "faults"
C4 = WIKITEXT.parents[1] / "calibration" / "c4-en-train-00000-sample.jsonl"
TOKENIZER_CALL = "transformers.tokenization_utils_base:PreTrainedTokenizerBase.__call__"
pytestmark = [pytest.mark.slow, pytest.mark.reliability]


def build_with_fault(model: Path, out: Path, fault: str, *extra: str, env: dict | None = None, formats="gguf-q8_0"):
    import os

    path = os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return quantforge_cli(
        "build",
        str(model),
        "--out",
        str(out),
        "--formats",
        formats,
        *FAST_EVAL,
        *extra,
        env={"PYTHONPATH": path, "QUANTFORGE_TEST_FAULT": fault, **(env or {})},
    )


def one_line(result, start: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(start)]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_a_tokenizer_failure_stops_the_build_in_one_line(tiny_llama, tmp_path):
    result = build_with_fault(tiny_llama, tmp_path / "run", f"{TOKENIZER_CALL}@quantforge.cli#encode")
    assert result.returncode == EXIT_BAD_INPUT
    line = one_line(result, "error: tokens failed in transformers ")
    assert "RuntimeError: injected failure" in line and "nothing was quantized" in line
    log = line.rsplit("(log: ", 1)[1].split(")")[0]
    assert "Traceback" in Path(log).read_text()
    assert not (tmp_path / "run" / "artifacts").exists()


def test_a_reference_failure_stops_the_build_and_keeps_the_tokens(tiny_llama, tmp_path):
    fault = "transformers.models.llama.modeling_llama:LlamaModel.forward@quantforge.cli"
    result = build_with_fault(tiny_llama, tmp_path / "run", fault)
    assert result.returncode == EXIT_BAD_INPUT
    line = one_line(result, "error: reference failed in transformers ")
    assert "injected failure in transformers.models.llama.modeling_llama:LlamaModel.forward" in line
    stages = read_json(tmp_path / "run" / "run.json")["stages"]
    assert "tokens" in stages and "reference" not in stages
    assert not (tmp_path / "run" / "artifacts").exists()


def test_a_failed_speed_probe_of_the_reference_leaves_its_speed_out_and_the_rest_measured(tiny_llama, tmp_path):
    fault = "transformers.models.auto.auto_factory:_BaseAutoModelClass.from_pretrained@quantforge.probe_process"
    out = tmp_path / "run"
    args = ("--speed", "--prompt-tokens", "8", "--gen-tokens", "4")
    result = build_with_fault(tiny_llama, out, fault, *args)
    assert result.returncode == EXIT_FORMATS_FAILED, result.stderr[-3000:]
    line = one_line(result, "failed: speed/reference failed in transformers ")
    assert "injected failure" in line
    card = read_json(out / "card.json")
    assert card["reference"]["speed"] is None
    [entry] = card["formats"]
    assert entry["complete"] and entry["speed"]["measured"]  # llama.cpp's probe ran as usual
    assert any(failure["key"] == "speed/reference" for failure in card["failed"])
    assert "speed/reference failed in transformers" in (out / "card.md").read_text()


def test_a_calibration_failure_fails_the_formats_that_calibrate_and_the_others_go_on(tiny_llama, tmp_path):
    out = tmp_path / "run"
    calibration = ("--calibration", str(C4), "--calib-samples", "4", "--calib-seqlen", "32")
    fault = f"{TOKENIZER_CALL}@quantforge.cli#tokenize_documents"
    result = build_with_fault(tiny_llama, out, fault, *calibration, formats="gguf-q8_0,gptq-int4")
    assert result.returncode == EXIT_FORMATS_FAILED, result.stderr[-3000:]
    line = one_line(result, "failed: gptq-int4: not made: calibration failed in transformers ")
    assert "injected failure" in line
    card = read_json(out / "card.json")
    complete = {entry["key"] for entry in card["formats"] if entry["complete"]}
    assert complete == {"gguf-q8_0"}
    assert [failure["key"] for failure in card["failed"]] == ["gptq-int4"]
    assert not (out / "artifacts" / "gptq-int4").exists()


def test_a_card_failure_keeps_every_measurement_and_the_card_command_writes_it_again(tiny_llama, tmp_path):
    out = tmp_path / "run"
    result = build_with_fault(tiny_llama, out, "", env={"MPLBACKEND": "no-such-backend"})
    assert result.returncode == EXIT_FORMATS_FAILED, result.stderr[-3000:]
    line = one_line(result, "error: card failed in matplotlib ")
    assert "every measurement is kept in run.json" in line
    assert "evaluate/gguf-q8_0" in read_json(out / "run.json")["stages"]
    again = quantforge_cli("card", str(out))
    assert again.returncode == 0, again.stderr
    assert read_json(out / "card.json")["formats"][0]["complete"]
