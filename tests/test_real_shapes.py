"""Every recipe's real shapes, and a real size of each family the README lists, through every stage of a build.

Small models hide large-model bugs: the chunked float32 widening of a Linear with a bias failed only above 2^20
weight elements (every Qwen2 model from 1.5B up), and no tiny model reached it. Each shape here is a random-weight
model with the real widths, heads, KV heads, vocabulary, biases and embedding tying of a published model, at two
decoder layers (tests/real_shapes.py writes it shard by shard). The build makes a GGUF file (llama.cpp's converter
and quantizer) and one torch format, evaluates both from disk against the reference, probes their speed, and every
stage's measured peak memory is held against the resource plan's prediction.
"""

from __future__ import annotations

import math
import shutil

import pytest
from conftest import WIKITEXT, quantforge_cli, read_json
from real_shapes import SHAPES, make_config, parameters, write_random_model

C4 = WIKITEXT.parents[1] / "calibration" / "c4-en-train-00000-sample.jsonl"
# Few and short windows, a short probe: the shapes, not the figures, are under test here.
SHAPE_ARGS = [
    *("--eval-text", str(WIKITEXT), "--ppl-context", "64", "--ppl-windows", "2", "--threads", "2"),
    *("--prompt-tokens", "8", "--gen-tokens", "4"),
    *("--calibration", str(C4), "--calib-samples", "4", "--calib-seqlen", "32", "--group-size", "auto"),
]
# Q8_0: the GGUF path at real sizes (converter, quantizer, evaluation from disk) at a fifth of Q4_K_M's quantizing
# time; K-quants at real widths run in scripts/bench_scale.py --shapes-7b.
GGUF_FORMAT = "gguf-q8_0"
# One torch format per recipe shape and for the mixture of experts (whose quantizer's memory has terms of its own),
# made by its library and evaluated from disk by dequantization. The other families build the GGUF path alone: FP8
# went through each of them once (docs/benchmarks.md, every stage within 0.97x of its plan), and its quantizer and
# evaluation do not switch on the architecture; leaving it out keeps CI's run near its 60 minutes.
TORCH_FORMAT = {"qwen2.5-7b": "fp8", "llama-3.1-8b": "fp8", "qwen1.5-moe-a2.7b": "fp8"} | {
    "smollm2-135m": "gptq-int4",
    # NVFP4 W4A4: its calibration and activation simulation at real widths; MLX: mlx-lm's converter and mlx's
    # evaluation at a real width and vocabulary (mlx is slow on this CPU: the 0.5B is the one shape it can afford)
    "qwen2.5-0.5b": "int8,nvfp4,mlx-8bit",
}
# Random weights give nearly flat distributions, on which quantization error still shows: mean KL measured on these
# shapes, Q8_0 at most 0.0012, FP8 0.002-0.022, INT8 (0.5B) 0.0009, NVFP4 W4A4 (0.5B) 0.0325, GPTQ int4 (SmolLM2)
# 0.0072, Q4_K_M 0.11-0.12
# (scripts/bench_scale). Limits about four times those: a broken format (a wrong scale, a transposed weight) is far
# above. The lower end allows the KL estimate's own noise (see below).
KLD_LIMIT = {"gguf-q4km": 0.5, "gguf-q8_0": 0.005, "fp8": 0.08, "int8": 0.005, "gptq-int4": 0.03, "nvfp4": 0.13}
KLD_LIMIT["mlx-8bit"] = 0.005
# Measured peak over planned peak, per stage, on these shapes (2 cores, 24 GB): at most 0.98 (dense shapes) and
# 1.10 (the MoE's reference); the plan may be generous, but must not be short by more than this.
MEMORY_RATIO_LIMIT = 1.25

# Each family's size as its model card states it (billions of parameters): the configs reproduce it at full depth
# within 2%, so their widths are the real ones. Recipes are held to their size: block exactly (read from the real
# checkpoint's safetensors headers) in the test below.
STATED_BILLIONS = {  # name: (full depth, billions)
    "gemma-3-1b": (26, 1.0),
    "phi-4-mini": (32, 3.84),
    "mistral-7b": (32, 7.25),
    "olmo-2-1b": (16, 1.48),
    "qwen3-4b": (36, 4.02),
    "qwen1.5-moe-a2.7b": (24, 14.3),
    "smollm2-135m": (30, 0.1345),
}


def test_every_recipe_has_its_real_shape():
    """A recipe added without a shape here would ship untested at its real size."""
    from quantforge.recipes import find_recipe, known_recipes

    covered = {s.recipe for s in SHAPES.values()} | {s.extra.get("also") for s in SHAPES.values()}
    assert set(known_recipes()) <= covered
    for shape in SHAPES.values():
        if shape.recipe is None:
            continue
        size = find_recipe(shape.recipe).size
        if not size:  # a bundled model: its real weights are built in full by the bundled-model tests
            continue
        config = make_config(shape)
        for key in ("hidden_size", "intermediate_size", "vocab_size", "tie_word_embeddings"):
            assert getattr(config, key) == size[key], (shape.recipe, key)
        name = next(n for n, s in SHAPES.items() if s is shape)
        assert parameters(name, size["num_layers"]) == size["parameters"], shape.recipe


@pytest.mark.parametrize("name", sorted(STATED_BILLIONS))
def test_each_family_shape_has_its_stated_size_at_full_depth(name):
    depth, billions = STATED_BILLIONS[name]
    assert parameters(name, depth) == pytest.approx(billions * 1e9, rel=0.02)


@pytest.mark.slow
@pytest.mark.xdist_group("real-shapes")  # one at a time, in one test process: up to 9 GB each
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_real_shape_builds_through_every_stage_within_its_plan(name, tmp_path):
    from quantforge.resources import plan_versus_actual

    model = write_random_model(name, tmp_path / name)
    out = tmp_path / "run"
    torch_formats = TORCH_FORMAT[name].split(",") if name in TORCH_FORMAT else []
    formats = ",".join([GGUF_FORMAT, *torch_formats])
    try:
        result = quantforge_cli("build", str(model), "--out", str(out), "--formats", formats, *SHAPE_ARGS)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        card = read_json(out / "card.json")
        entries = {entry["key"]: entry for entry in card["formats"]}
        assert set(entries) == set(formats.split(","))
        for key, entry in entries.items():
            assert entry["complete"], key
            print(f"{name} {key}: KLD {entry['metrics']['kld_mean']:.4f}")
            metrics = entry["metrics"]
            # Random weights give nearly flat next-token distributions: the figures are small but finite, and each
            # artifact was scored on the reference's tokens.
            assert math.isfinite(metrics["perplexity"]) and math.isfinite(metrics["kld_mean"]), (key, metrics)
            # The KL estimate (64 top tokens exactly, the tail sampled) is unbiased, not non-negative: at Q8_0 on
            # flat distributions (true KL about 1e-4) OLMo 2's came out at -0.0002.
            assert -1e-3 < metrics["kld_mean"] < KLD_LIMIT[key], (key, metrics)
            assert metrics["tokens_scored"] == card["reference"]["tokens_scored"]
        # llama.cpp's probe runs here; the torch formats' runtime is vLLM, on a GPU, and says so
        assert entries[GGUF_FORMAT]["speed"]["measured"], entries[GGUF_FORMAT]["speed"]
        for key in torch_formats:
            torch_speed = entries[key]["speed"]
            assert torch_speed["measured"] or "vLLM" in torch_speed["reason"], torch_speed
        assert card["reference"]["speed"]["measured"]
        manifest = read_json(out / "run.json")
        rows = plan_versus_actual(manifest["resource_plan"], manifest["stages"])
        measured = {row["key"]: row for row in rows if row["memory_ratio"] is not None}
        for stage in ("reference", f"quantize/{GGUF_FORMAT}", f"evaluate/{GGUF_FORMAT}"):
            assert stage in measured, stage
        for key, row in measured.items():
            print(f"{name} {key}: memory {row['memory_ratio']}x, time {row['time_ratio']}x of the plan")
        for key, row in measured.items():
            assert row["memory_ratio"] <= MEMORY_RATIO_LIMIT, (name, key, row)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # up to 9 GB per shape: none is kept for the next
