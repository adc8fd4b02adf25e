"""NVFP4 and MXFP4 (issue 37) through llm-compressor on the tiny llama: the compressed-tensors checkpoints vLLM
serves, evaluated from disk, checked op by op against compressed-tensors' own decompression and activation
quantization (the second source; conftest.fp4_against_the_library says why op by op).

Measured first on SmolLM2-135M's NVFP4 file: none of a down_proj's 884,736 weights differs from the library's
decompressed bf16 one, and the library's activation quantization equals quantforge's on 43,008 float32 values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST_EVAL, SHARED_DATA, build_run, fp4_against_the_library, read_json
from safetensors import safe_open

FP4_FORMATS = ("nvfp4", "nvfp4-a16", "mxfp4-a16")
CALIBRATION = [
    "--calibration",
    str(SHARED_DATA / "calibration" / "c4-en-train-00000-sample.jsonl"),
    "--calib-samples",
    "8",
    "--calib-seqlen",
    "64",
]


@pytest.fixture(scope="module")
def fp4_run(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp4") / "run"
    return build_run(tiny_llama, out, "--formats", ",".join(FP4_FORMATS), *FAST_EVAL, *CALIBRATION)


@pytest.mark.parametrize(
    "key, packing, group, scale_dtype",
    [
        ("nvfp4", "nvfp4-pack-quantized", 16, "F8_E4M3"),
        ("nvfp4-a16", "nvfp4-pack-quantized", 16, "F8_E4M3"),
        ("mxfp4-a16", "mxfp4-pack-quantized", 32, "U8"),
    ],
)
def test_fp4_checkpoints_are_what_vllm_loads(fp4_run, key, packing, group, scale_dtype):
    folder = fp4_run / "artifacts" / key
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == packing
    [scheme] = quant["config_groups"].values()
    assert scheme["weights"]["type"] == "float" and scheme["weights"]["num_bits"] == 4
    assert scheme["weights"]["group_size"] == group
    assert (scheme["input_activations"] is not None) == (key == "nvfp4")
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_slice("model.layers.0.mlp.down_proj.weight_packed").get_dtype() == "U8"
        assert handle.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_dtype() == scale_dtype
        assert ("model.layers.0.mlp.down_proj.input_global_scale" in names) == (key == "nvfp4")
        assert handle.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"  # tied: 16 bits
    stages = read_json(fp4_run / "run.json")["stages"]
    calibrated = key == "nvfp4"  # the activations' global scales come from the calibration set
    assert ("calibration_samples" in stages[f"quantize/{key}"]["result"]) == calibrated


def test_fp4_formats_are_on_the_card_with_interval_gpu_generations_and_serve_command(fp4_run):
    card = read_json(fp4_run / "card.json")
    entries = {e["key"]: e for e in card["formats"]}
    for key in FP4_FORMATS:
        entry = entries[key]
        assert entry["complete"] and entry["family"] == "hf"
        interval = entry["intervals"]["kld_mean"]
        assert interval["low"] <= entry["metrics"]["kld_mean"] <= interval["high"]
        readme = (fp4_run / "artifacts" / key / "README.md").read_text()
        assert "vllm serve" in readme and "--quantization" not in readme
    assert entries["nvfp4"]["gpu_generations"] == ["blackwell"]
    assert entries["nvfp4"]["gpu_weight_only"] == ["ampere", "ada", "hopper"]
    # The memory table says per GPU where vLLM runs each file, as made or its weights alone
    table = (fp4_run / "card.md").read_text().split("## Memory fit")[1].split("\n## ")[0]
    header = next(line for line in table.splitlines() if line.startswith("| format |"))
    gpus = [cell.strip() for cell in header.strip("|").split("|")]
    row = next(line for line in table.splitlines() if line.startswith("| nvfp4 |"))
    cells = dict(zip(gpus, (cell.strip() for cell in row.strip("|").split("|")), strict=True))
    assert cells["T4"] == "does not run (Turing)"
    assert cells["H100"].endswith("; weights alone") and "weights alone" not in cells["B200"]
    # 4 bits and a scale byte per 16 (NVFP4) or 32 (MXFP4) weights: MXFP4's file is the smaller
    assert entries["mxfp4-a16"]["bits_per_weight"] < entries["nvfp4-a16"]["bits_per_weight"]


@pytest.mark.parametrize("key", FP4_FORMATS)
def test_fp4_evaluation_matches_compressed_tensors_op_by_op(fp4_run, key):
    found = fp4_against_the_library(fp4_run / "artifacts" / key, fp4_run / "work" / "eval-windows.npy")
    print(key, found)
    assert found["linears"] == 7 * 2  # q, k, v, o, gate, up, down in each of the tiny llama's two layers
    assert found["weights_differing"] == 0 and found["activations_differing"] == 0, found


def test_nvfp4_activations_cost_what_its_weights_alone_do_not(fp4_run):
    """The W4A4 file's figures include its FP4 activations: its KL is above the weight-only NVFP4 file's, made from
    the same weights by the same rounding."""
    entries = {e["key"]: e for e in read_json(fp4_run / "card.json")["formats"]}
    both, weights = entries["nvfp4"]["metrics"]["kld_mean"], entries["nvfp4-a16"]["metrics"]["kld_mean"]
    print(f"KL mean: W4A4 {both:.4f}, W4A16 {weights:.4f}")
    assert both > 1.2 * weights
