"""Bad input: one line on stderr, exit code 2, and nothing an earlier run produced is touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import FAST_EVAL, quantforge_cli, tree_digest

pytestmark = pytest.mark.reliability


def assert_clean_error(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    return run


def _build_into(run: Path, *args: str):
    before = tree_digest(run)
    result = quantforge_cli("build", *args, "--out", str(run), *FAST_EVAL)
    assert tree_digest(run) == before, "a failed build changed the earlier run"
    return result


def test_unknown_model(run_copy):
    assert_clean_error(_build_into(run_copy, "no-such-model"), "unknown model 'no-such-model'", "Hub id")


def test_unknown_format(run_copy, tiny_llama):
    result = _build_into(run_copy, str(tiny_llama), "--formats", "gguf-q3_k_xs")
    assert_clean_error(result, "unknown format 'gguf-q3_k_xs'", "gguf-q4km")


def test_unknown_backend(run_copy, tiny_llama):
    result = _build_into(run_copy, str(tiny_llama), "--formats", "gguf-q4km", "--backend", "nope")
    assert_clean_error(result, "unknown backend 'nope'", "llamacpp")


def test_folder_without_config(run_copy, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_clean_error(_build_into(run_copy, str(empty)), "no config.json")


def test_folder_that_is_not_a_causal_lm(run_copy, tiny_llama, tmp_path):
    folder = tmp_path / "encoder"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (folder / "config.json").write_text(json.dumps(config))
    assert_clean_error(_build_into(run_copy, str(folder)), "not a causal LM", "BertModel")


def test_architecture_gguf_cannot_convert(tiny_llama, tmp_path):
    """An architecture llama.cpp's converter does not know, and only GGUF asked for: refused before any work."""
    folder = tmp_path / "madeup"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    run = tmp_path / "run"
    result = quantforge_cli("build", str(folder), "--formats", "gguf-q4km", "--out", str(run), *FAST_EVAL)
    assert_clean_error(result, "MadeUpForCausalLM is not one llama.cpp's GGUF converter knows", "llama-cpp-python 0.")
    assert not (run / "artifacts").exists()


def test_config_transformers_cannot_read(tiny_llama, tmp_path):
    folder = tmp_path / "unreadable"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model_type"}))
    run = tmp_path / "run"
    result = quantforge_cli("build", str(folder), "--formats", "gguf-q8_0", "--out", str(run), *FAST_EVAL)
    assert_clean_error(result, "transformers 5.", "cannot read", "config.json", "no_such_model_type")
    assert not (run / "artifacts").exists() and not (run / "work").exists()


def test_pickle_only_weights_are_refused(run_copy, tiny_llama, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_llama, folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    assert_clean_error(_build_into(run_copy, str(folder)), "only pickle weights", "--allow-pickle")


def test_corrupted_safetensors(run_copy, tiny_llama, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_clean_error(_build_into(run_copy, str(folder)), "corrupted", "model.safetensors")


def test_a_nan_weight_is_refused_naming_the_tensor_before_anything_is_quantized(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan-weight"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    broken = "model.layers.0.mlp.down_proj.weight"
    weights[broken][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "run"
    result = quantforge_cli("build", str(folder), "--out", str(out), "--formats", "gguf-q8_0", *FAST_EVAL)
    assert_clean_error(
        result, "the reference's negative log likelihood at window 1, position 1 is nan", f"{broken} (1 NaN)"
    )
    manifest = json.loads((out / "run.json").read_text())
    assert "reference" not in manifest["stages"] and not any(k.startswith("quantize") for k in manifest["stages"])


def test_a_different_model_into_an_existing_run(run_copy, tiny_qwen2):
    result = _build_into(run_copy, str(tiny_qwen2), "--formats", "gguf-q8_0")
    assert_clean_error(result, "holds a run of", "--force")


def test_hub_id_without_network_or_cache(run_copy, tmp_path):
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    before = tree_digest(run_copy)
    result = quantforge_cli("build", "acme/not-cached", "--out", str(run_copy), *FAST_EVAL, env=env)
    assert_clean_error(result, "acme/not-cached is not in the local Hugging Face cache")
    assert tree_digest(run_copy) == before


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("model: bundled:smollm2-135m\nformats: [gguf-q4km\n", ["malformed YAML"]),
        ("model: bundled:smollm2-135m\nformat: [gguf-q4km]\n", [":2:", "unknown key 'format'", "formats"]),
        ("model: bundled:smollm2-135m\neval:\n  windowz: 4\n", [":3:", "unknown key 'eval.windowz'"]),
        ("model: bundled:smollm2-135m\neval:\n  context: lots\n", [":3:", "'eval.context' must be an integer"]),
        ("formats: [gguf-q4km]\n", ["no 'model' key"]),
        (b"model: bundled:smollm2-135m\nname: caf\xe9\n", ["not UTF-8 text (byte 37)", "save the recipe as UTF-8"]),
        ("model: bundled:smollm2-135m\n? [a, b]\n: 1\n", [":2:", "a key must be a plain name"]),
        ("model: bundled:smollm2-135m\neval: {{context: 1}: 2}\n", [":2:", "a key must be a plain name"]),
    ],
)
def test_malformed_recipe(run_copy, tmp_path, text, fragments):
    recipe = tmp_path / "bad.yaml"
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_clean_error(_build_into(run_copy, "--recipe", str(recipe)), str(recipe), *fragments)


def test_out_naming_a_file(tiny_llama, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me\n")
    result = quantforge_cli("build", str(tiny_llama), "--out", str(existing), *FAST_EVAL)
    assert_clean_error(result, f"--out {existing} is a file")
    assert existing.read_text() == "keep me\n"


def test_card_of_a_folder_that_is_not_a_run(tmp_path):
    assert_clean_error(quantforge_cli("card", str(tmp_path)), "holds no quantforge run")


def test_a_failing_tool_is_one_line_naming_it_and_its_log(tmp_path):
    import sys

    from quantforge.errors import QuantforgeError
    from quantforge.logs import run_logged

    failing = [sys.executable, "-c", "import sys; print('working'); sys.exit('no such tensor: blk.0')"]
    with pytest.raises(QuantforgeError) as caught:
        run_logged(failing, tmp_path / "logs" / "tool.log", "llama.cpp's llama-imatrix")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("llama.cpp's llama-imatrix failed (exit 1)")
    assert "no such tensor: blk.0" in message and str(tmp_path / "logs" / "tool.log") in message
    assert "working" in (tmp_path / "logs" / "tool.log").read_text()  # the whole output is kept for reading
