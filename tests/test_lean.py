"""Memory-lean evaluation computes the very numbers a float32 model computes (see quantforge/lean.py).

Every tiny architecture is stored in bf16, as Hub checkpoints are; its logits through the lean loader must equal,
bit for bit, those of transformers loading it in float32. The hooks are forced onto every weight (no parameter is
"small", every Linear is chunked), so each path of the lean code runs on each architecture.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tiny_models import ARCHITECTURES

import quantforge.lean as lean


@pytest.fixture
def every_weight_lean(monkeypatch):
    monkeypatch.setattr(lean, "SMALL_PARAMETER", 0)
    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", 1 << 16)
    import quantforge.dequant as dequant

    monkeypatch.setattr(dequant, "SMALL_PARAMETER", 0)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_stored_dtype_model_gives_float32_logits_exactly(tiny_model, kind, every_weight_lean):
    from transformers import AutoModelForCausalLM

    folder = tiny_model(kind)
    lean_model = lean.stored_dtype_model(folder)
    stored = {p.dtype for p in lean_model.parameters()}
    assert stored == {torch.bfloat16}, stored  # nothing was widened for good
    ids = torch.randint(3, 1000, (1, 80), generator=torch.Generator().manual_seed(0))
    ours = _logits(lean_model, ids)
    float32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert ours.dtype == torch.float32
    assert torch.equal(ours, _logits(float32, ids))


@pytest.mark.parametrize("small", [lean.SMALL_PARAMETER, 0], ids=["biases-widened-once", "biases-kept-stored"])
def test_a_chunked_linear_with_a_bias_gives_float32_logits_exactly(tiny_model, small, monkeypatch):
    """Qwen2's q/k/v projections have biases. Above CHUNK_ELEMENTS (Qwen2.5-1.5B and up: hidden 1536) their forward
    widens a slice of rows at a time; it once kept the bias as it was before widening and failed with "self and
    mat2 must have the same dtype". Chunks forced small here so the tiny qwen2's q_proj takes that path."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", 1 << 15)  # q_proj (256 x 256) in two slices of 128 rows
    monkeypatch.setattr(lean, "SMALL_PARAMETER", small)
    folder = tiny_model("qwen2")
    lean_model = lean.stored_dtype_model(folder)
    q_proj = lean_model.model.layers[0].self_attn.q_proj
    assert q_proj.bias is not None and "forward" in vars(q_proj)  # the chunked path, with a bias
    ids = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    float32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.equal(_logits(lean_model, ids), _logits(float32, ids))


def test_lean_model_holds_less_than_float32(tiny_model):
    folder = tiny_model("qwen2")  # a 151,936-token table: the embedding dominates
    model = lean.stored_dtype_model(folder)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    float32 = sum(p.numel() * 4 for p in model.parameters())
    assert held < 0.55 * float32


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_scored_logits_in_blocks_are_the_whole_windows_rows(tiny_model, kind, monkeypatch):
    """The reference scores a window from the head's logits a block of rows at a time, run through the model's own
    forward (gemma3's soft-capping included): the whole window's numbers, and the model's body is left as it
    was."""
    import numpy as np

    import quantforge.runners as runners

    monkeypatch.setattr(runners, "HEAD_ROWS", 16)
    runner = runners.TorchRunner(lean.stored_dtype_model(tiny_model(kind)), threads=2)
    tokens = np.random.default_rng(0).integers(3, 1000, 80)
    blocks = [np.array(block) for block in runner.scored_logits(tokens)]
    assert [len(b) for b in blocks] == [16, 16, 16, 16, 15]
    whole = runner.logits(tokens)[:-1]
    # Bit for bit on this project's hosts; MKL may sum a differently shaped product in another order elsewhere.
    np.testing.assert_allclose(np.concatenate(blocks), whole, rtol=1e-5, atol=1e-5)
    assert np.abs(np.diff(whole, axis=0)).max() > 1e-2  # a block cut or shifted wrongly would break the check
    # from a later first position (llama-perplexity's second half): only those rows, in blocks from there
    later = [np.array(block) for block in runner.scored_logits(tokens, first=40)]
    assert [len(b) for b in later] == [16, 16, 7]
    np.testing.assert_allclose(np.concatenate(later), whole[40:], rtol=1e-5, atol=1e-5)
    assert "forward" not in vars(runner.model.base_model)


def test_a_model_loads_without_scikit_learn_and_it_stays_importable(tiny_llama):
    """transformers would import scikit-learn (and with it pandas and pyarrow: 0.1 GB resident), scipy and torchao
    in every process that loads a model; quantforge loads models with them reported absent, and they import normally
    afterwards (lm-eval's metrics use scikit-learn). In a fresh interpreter: this one may have imported them."""
    script = f"""
import sys
import numpy as np
from quantforge.runners import TorchRunner
runner = TorchRunner.from_folder({str(tiny_llama)!r}, threads=1)
logits = runner.logits(np.arange(100, 116))
assert logits.shape[0] == 16 and np.isfinite(logits).all()
for package in ("sklearn", "scipy", "torchao"):
    assert package not in sys.modules, package + " came in with the model"
assert "pandas" not in sys.modules
import scipy.optimize, sklearn.metrics, torchao
print("ok", sklearn.metrics.accuracy_score([1, 0], [1, 1]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["ok", "0.5"]
