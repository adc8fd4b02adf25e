"""FP8 W8A8 (llm-compressor's FP8_DYNAMIC) on the tiny llama: the checkpoint vLLM serves, its evaluation from disk,
and that evaluation against the serving library's own decompression.

The second source: transformers loads the folder through compressed-tensors (the library whose checkpoint format
vLLM loads) and runs it with that library's own decompression and its own simulation of the per-token FP8
activations; quantforge's evaluation reads the same tensors and simulates the activations with its own code. The two
must agree to float arithmetic: per-position KL below 1e-3 (measured: exactly 0, the same float32 logits). Without
its activation simulation quantforge's figures would be off by what FP8 activations cost, which must show (measured:
mean KL 0.011 on this random model), so the agreement is not that of two runs that both leave them out.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAST_EVAL, quantforge_cli, read_json
from safetensors import safe_open


@pytest.fixture(scope="module")
def fp8_run(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "run"
    result = quantforge_cli("build", str(tiny_llama), "--out", str(out), "--formats", "fp8", *FAST_EVAL)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_fp8_checkpoint_is_compressed_tensors_float_quantized_and_needs_no_calibration(fp8_run):
    folder = fp8_run / "artifacts" / "fp8"
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "float-quantized"
    [group] = quant["config_groups"].values()
    assert group["weights"]["type"] == "float" and group["weights"]["strategy"] == "channel"
    assert group["input_activations"] == {**group["input_activations"], "dynamic": True, "strategy": "token"}
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        assert handle.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype() == "F8_E4M3"
        # the (tied) embedding and LM head stay in 16 bits
        assert handle.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    stages = read_json(fp8_run / "run.json")["stages"]
    assert "calibration" not in stages  # data-free: no calibration set was made for it
    assert stages["quantize/fp8"]["result"]["calibration"] == "none (data-free)"


def test_fp8_is_on_the_card_with_its_interval_and_serve_command(fp8_run):
    card = read_json(fp8_run / "card.json")
    entry = next(e for e in card["formats"] if e["key"] == "fp8")
    assert entry["complete"] and entry["family"] == "hf"
    assert 7.5 < entry["bits_per_weight"] < 16  # FP8 layers, a bf16 embedding table (tied) over a tiny model
    interval = entry["intervals"]["kld_mean"]
    assert interval["low"] <= entry["metrics"]["kld_mean"] <= interval["high"]
    readme = (fp8_run / "artifacts" / "fp8" / "README.md").read_text()
    assert "vllm serve" in readme and "--quantization" not in readme


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> np.ndarray:
    p, q = _log_softmax(p_logits), _log_softmax(q_logits)
    return (p.exp() * (p - q)).sum(-1).numpy()


def test_fp8_evaluation_matches_the_serving_librarys_own_decompression(fp8_run):
    from transformers import AutoModelForCausalLM

    from quantforge.dequant import float_model_from_artifact

    folder = fp8_run / "artifacts" / "fp8"
    windows = torch.from_numpy(np.load(fp8_run / "work" / "eval-windows.npy")).long()
    theirs_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert theirs_model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn  # compressed-tensors' own
    ours_model = float_model_from_artifact(folder).eval()
    weights_only = float_model_from_artifact(folder, simulate_activations=False).eval()
    with torch.inference_mode():
        theirs, ours, unsimulated = (
            torch.cat([model(input_ids=w[None]).logits[0] for w in windows])
            for model in (theirs_model, ours_model, weights_only)
        )
    agreement = _kl(theirs, ours)
    assert agreement.max() < 1e-3, agreement.max()
    activations_cost = _kl(theirs, unsimulated)
    assert activations_cost.mean() > 1e-3, activations_cost.mean()
