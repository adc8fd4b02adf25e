"""The calibrated GGUF backend (auto-round) beside llama.cpp's quantizer, on the tiny model."""

from __future__ import annotations

import pytest
from conftest import CALIBRATION, FAST_EVAL, build_run, read_json

from quantforge.backends.llamacpp import tensor_types


@pytest.fixture(scope="module")
def both_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "gguf-both"
    both = ["--formats", "gguf-q4km,gguf-q5km", "--backend", "llamacpp,autoround", *FAST_EVAL, *CALIBRATION]
    # HF_HUB_OFFLINE: auto-round must not reach for its default calibration set on the Hub.
    return build_run(tiny_llama, out, *both, env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})


def test_both_backends_side_by_side_with_the_same_tensor_types(both_run):
    card = read_json(both_run / "card.json")
    keys = [e["key"] for e in card["formats"]]
    assert keys == ["gguf-q4km", "gguf-q4km@autoround", "gguf-q5km", "gguf-q5km@autoround"]
    for fmt in ("gguf-q4km", "gguf-q5km"):
        ours = tensor_types(next((both_run / "artifacts" / f"{fmt}@autoround").glob("*.gguf")))
        reference = tensor_types(next((both_run / "artifacts" / fmt).glob("*.gguf")))
        assert ours == reference, fmt
    entries = {e["key"]: e for e in card["formats"]}
    assert entries["gguf-q4km@autoround"]["size_bytes"] == pytest.approx(entries["gguf-q4km"]["size_bytes"], rel=0.001)


def test_the_calibrated_files_are_evaluated_in_llama_cpp_by_the_same_stages(both_run):
    card = read_json(both_run / "card.json")
    for entry in card["formats"]:
        assert entry["how"]["runtime"] == "llama.cpp"
        assert entry["metrics"]["tokens_scored"] == card["reference"]["tokens_scored"]
    calibrated = next(e for e in card["formats"] if e["key"] == "gguf-q4km@autoround")
    assert calibrated["quantize"]["library"] == "auto-round" and calibrated["quantize"]["iters"] == 0
    stages = read_json(both_run / "run.json")["stages"]
    assert stages["quantize/gguf-q4km@autoround"]["inputs"]["calibration"]


def test_the_card_says_which_of_two_equal_size_files_is_better(both_run):
    card = read_json(both_run / "card.json")
    pairs = {p["format"]: p for p in card["same_format"]}
    entries = {e["key"]: e for e in card["formats"]}
    assert set(pairs) == {"gguf-q4km", "gguf-q5km"}
    for fmt, pair in pairs.items():
        # the pair is the two files of that format, ranked by their own measured KL divergence
        assert {pair["better"], pair["worse"]} == {fmt, f"{fmt}@autoround"}
        kld = {key: entries[key]["metrics"]["kld_mean"] for key in (pair["better"], pair["worse"])}
        assert kld[pair["better"]] <= kld[pair["worse"]]
        assert pair["kld_ratio"] == pytest.approx(kld[pair["better"]] / kld[pair["worse"]])
        assert abs(pair["size_ratio"] - 1) < 0.01
        assert (
            f"**{pair['better']}** is closer to the reference than {pair['worse']}"
            in (both_run / "card.md").read_text()
        )


def test_calibrated_files_load_and_generate_in_llama_cpp(both_run):
    from llama_cpp import Llama

    for gguf in sorted((both_run / "artifacts").glob("*@autoround/*.gguf")):
        llm = Llama(str(gguf), n_ctx=64, n_threads=2, verbose=False)
        assert llm("Hello", max_tokens=4, temperature=0)["usage"]["completion_tokens"] > 0
        llm.close()
