"""The evaluation runtime's child process: the logits that come across it are the runtime's own, bit for bit, and a
child that dies or fails is told in one line. (A whole build whose runtime aborts is in test_plugin_backend.py.)"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from quantforge.backends import load_backend
from quantforge.errors import QuantforgeError
from quantforge.memory import StagePeak
from quantforge.runner_process import SHARED_ROWS, ChildRunner

# (backend, artifact) of the session's mixed run: llama.cpp's runtime, and a GPTQ folder dequantized in torch
ARTIFACTS = [("llamacpp", "gguf-q8_0"), ("gptqmodel", "gptq-int4")]
CONTEXT = 300  # over one block of either runtime (llama.cpp 256 rows, torch 128), so windows come in several


def _window(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 250, size=length).astype(np.int32)


def _open(backend: str, artifact, tmp_path) -> ChildRunner:
    return ChildRunner(backend, artifact, context=CONTEXT, threads=2, device="cpu", log_path=tmp_path / "eval.log")


@pytest.mark.parametrize("backend, key", ARTIFACTS)
def test_the_childs_logits_are_the_runtimes_own_bit_for_bit(mixed_run, tmp_path, backend, key):
    artifact = mixed_run / "artifacts" / key
    window = _window(CONTEXT, 1)
    own = load_backend(backend).open_runner(artifact, context=CONTEXT, threads=2)
    child = _open(backend, artifact, tmp_path)
    try:
        assert child.runtime == own.runtime
        assert np.array_equal(child.logits(window[:40]), own.logits(window[:40]))
        theirs = [np.array(block) for block in child.scored_logits(window)]
        ours = [np.array(block) for block in own.scored_logits(window)]
        # the runtime's blocks cross in pieces of SHARED_ROWS rows: the same rows, in order
        assert len(theirs) > len(ours) > 1 and max(len(piece) for piece in theirs) == SHARED_ROWS
        assert np.array_equal(np.concatenate(theirs), np.concatenate(ours))
        # llama-perplexity's second half (--ppl-scoring second-half): the output layer skips the first half, and
        # the rows are the whole window's, to rounding
        half = [np.array(block) for block in child.scored_logits(window, first=CONTEXT // 2)]
        own_half = [np.array(block) for block in own.scored_logits(window, CONTEXT // 2)]
        assert np.array_equal(np.concatenate(half), np.concatenate(own_half))
        tail = np.concatenate(ours)[CONTEXT // 2 :]
        assert np.concatenate(half).shape == tail.shape
        np.testing.assert_allclose(np.concatenate(half), tail, rtol=0, atol=1e-4 * np.abs(tail).max())
        # a task's answer: its last rows alone, the output layer run on those (as on the whole window, to rounding);
        # 50 rows of 300 straddle llama.cpp's two blocks
        answer = child.last_logits(window, 50)
        assert answer.shape[0] == 50 and np.array_equal(answer, own.last_logits(window, 50))
        whole = own.logits(window)[-50:]
        np.testing.assert_allclose(answer, whole, rtol=0, atol=1e-4 * np.abs(whole).max())
        assert np.array_equal(answer.argmax(axis=-1), whole.argmax(axis=-1))
        # a window left after its first block: the next request is answered, not the stream's next block
        assert next(iter(child.scored_logits(_window(CONTEXT, 2)))).shape[0] > 1
        assert np.array_equal(child.logits(window[:30]), own.logits(window[:30]))
    finally:
        own.close()
        child.close()
    assert child.process.returncode == 0  # it ended by itself when its input closed


def test_the_childs_peak_memory_goes_to_the_stage_that_ran_it(mixed_run, tmp_path):
    artifact = mixed_run / "artifacts" / "gguf-q8_0"
    gguf_bytes = next(artifact.glob("*.gguf")).stat().st_size
    with StagePeak() as loading:
        child = _open("llamacpp", artifact, tmp_path)
    try:
        with StagePeak() as scoring:
            blocks = list(np.array(block) for block in child.scored_logits(_window(CONTEXT, 3)))
    finally:
        child.close()
    for stage in (loading, scoring):
        measured = stage.to_json()
        assert gguf_bytes < measured["child_peak_rss_bytes"] < 1 << 30  # the model mapped, well under a torch process
        assert measured["host_peak_rss_bytes"] == measured["peak_rss_bytes"] + measured["child_peak_rss_bytes"]
    assert sum(len(block) for block in blocks) == CONTEXT - 1


@pytest.mark.parametrize(
    "sent, said",
    [
        (signal.SIGKILL, "was killed (SIGKILL), most likely by the system for lack of memory; see --plan-only"),
        (signal.SIGSEGV, "was ended by SIGSEGV"),
    ],
)
def test_a_runtime_process_that_dies_is_one_line(mixed_run, tmp_path, sent, said):
    child = _open("llamacpp", mixed_run / "artifacts" / "gguf-q8_0", tmp_path)
    os.kill(child.process.pid, sent)
    with pytest.raises(QuantforgeError) as raised:
        list(child.scored_logits(_window(CONTEXT, 4)))
    assert str(raised.value).startswith(f"the evaluation runtime's process {said}")
    child.close()
    assert child.process.returncode == -sent


def test_an_error_loading_the_artifact_comes_back_as_its_own_line(tmp_path):
    folder = tmp_path / "gguf-q8_0"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(QuantforgeError, match="not a GGUF file") as raised:
        load_backend("llamacpp").open_runner(folder, context=CONTEXT, threads=1)
    with pytest.raises(QuantforgeError) as across:
        _open("llamacpp", folder, tmp_path)
    assert str(across.value) == str(raised.value)
    with pytest.raises(QuantforgeError, match="unknown backend 'no-such-backend'"):
        _open("no-such-backend", folder, tmp_path)
