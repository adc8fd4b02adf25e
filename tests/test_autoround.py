"""The calibrated GGUF backends (llama.cpp with an importance matrix, auto-round) beside llama.cpp's plain
quantizer, on the tiny model: one build with all three, as a user comparing them would run it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import CALIBRATION, FAST_EVAL, build_run, quantforge_cli, read_json

from quantforge.backends.llamacpp import tensor_types

pytestmark = pytest.mark.slow  # one build with three calibrated backends (about 80 s)


@pytest.fixture(scope="module")
def both_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "gguf-calibrated"
    both = ["--formats", "gguf-q4km,gguf-q5km", "--backend", "llamacpp,imatrix,autoround", *FAST_EVAL, *CALIBRATION]
    # HF_HUB_OFFLINE: auto-round must not reach for its default calibration set on the Hub.
    return build_run(tiny_llama, out, *both, env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})


CALIBRATED = ("autoround", "imatrix")


def test_three_backends_side_by_side_with_the_same_tensor_types(both_run):
    card = read_json(both_run / "card.json")
    keys = sorted(e["key"] for e in card["formats"])
    assert keys == sorted(
        f"{fmt}{suffix}" for fmt in ("gguf-q4km", "gguf-q5km") for suffix in ("", "@autoround", "@imatrix")
    )
    entries = {e["key"]: e for e in card["formats"]}
    for fmt in ("gguf-q4km", "gguf-q5km"):
        reference = tensor_types(next((both_run / "artifacts" / fmt).glob("*.gguf")))
        for backend in CALIBRATED:
            assert tensor_types(next((both_run / "artifacts" / f"{fmt}@{backend}").glob("*.gguf"))) == reference
            assert entries[f"{fmt}@{backend}"]["size_bytes"] == pytest.approx(entries[fmt]["size_bytes"], rel=0.001)


def test_the_calibrated_files_are_evaluated_in_llama_cpp_by_the_same_stages(both_run):
    card = read_json(both_run / "card.json")
    for entry in card["formats"]:
        assert entry["how"]["runtime"] == "llama.cpp"
        assert entry["metrics"]["tokens_scored"] == card["reference"]["tokens_scored"]
    calibrated = next(e for e in card["formats"] if e["key"] == "gguf-q4km@autoround")
    assert calibrated["quantize"]["library"] == "auto-round" and calibrated["quantize"]["iters"] == 0
    stages = read_json(both_run / "run.json")["stages"]
    # one calibration set for both calibrated backends; the importance matrix is made once, from it and the F16 file
    assert len({stages[f"quantize/gguf-q4km@{backend}"]["inputs"]["calibration"] for backend in CALIBRATED}) == 1
    assert set(stages["intermediate/imatrix"]["inputs"]) == {"source", "gguf-f16", "calibration"}
    assert (
        stages["intermediate/imatrix"]["inputs"]["calibration"]
        == stages["quantize/gguf-q4km@imatrix"]["inputs"]["calibration"]
    )


def test_the_card_says_which_of_two_equal_size_files_is_better(both_run):
    card = read_json(both_run / "card.json")
    pairs = {p["format"]: p for p in card["same_format"]}
    entries = {e["key"]: e for e in card["formats"]}
    assert set(pairs) == {"gguf-q4km", "gguf-q5km"}
    assert len(card["same_format"]) == 6  # every two of the three files of each format
    for pair in card["same_format"]:
        fmt = pair["format"]
        # the pair is the two files of that format, ranked by their own measured KL divergence
        assert {pair["better"], pair["worse"]} <= {fmt, f"{fmt}@autoround", f"{fmt}@imatrix"}
        kld = {key: entries[key]["metrics"]["kld_mean"] for key in (pair["better"], pair["worse"])}
        assert kld[pair["better"]] <= kld[pair["worse"]]
        assert pair["kld_ratio"] == pytest.approx(kld[pair["better"]] / kld[pair["worse"]])
        assert abs(pair["size_ratio"] - 1) < 0.01
        assert (
            f"**{pair['better']}** is closer to the reference than {pair['worse']}"
            in (both_run / "card.md").read_text()
        )


def test_equal_size_files_are_ranked_by_their_distance_from_the_reference(both_run, tmp_path):
    """Issue 36: the plain, importance-matrix and AutoRound files of one type hold the same tensor bytes, so
    alphabetical order once decided between them. The recommendation and the smallest qualifying file are now the
    closest of their size, and the others say why they lost."""
    run = tmp_path / "run"
    shutil.copytree(both_run, run)  # 'card' rewrites the card with these targets
    result = quantforge_cli("card", str(run), "--json", "--max-ppl-increase", "1000", "--max-kld", "1000")
    assert result.returncode == 0, result.stderr[-2000:]
    decision = json.loads(result.stdout)["decision"]
    entries = {e["key"]: e for e in read_json(both_run / "card.json")["formats"]}
    closest = {
        fmt: min((k for k in entries if k.split("@")[0] == fmt), key=lambda k: entries[k]["metrics"]["kld_mean"])
        for fmt in ("gguf-q4km", "gguf-q5km")
    }
    assert decision["recommended"] == closest["gguf-q5km"]
    assert decision["smallest"] == closest["gguf-q4km"]
    verdicts = {v["key"]: v for v in decision["verdicts"]}
    for key in entries:
        if key in closest.values():
            continue
        fmt = key.split("@")[0]
        farther = f"same size as {closest[fmt]}, farther from the reference: KLD"
        assert verdicts[key]["outcome"] == "meets targets" and verdicts[key]["reason"].startswith(farther), verdicts
    assert verdicts[closest["gguf-q4km"]]["reason"].endswith("the smallest file that meets every target")


def test_require_recommendation_gates_the_exit_status(both_run, tmp_path):
    entries = read_json(both_run / "card.json")["formats"]
    best = min(e["metrics"]["kld_mean"] for e in entries)
    run = tmp_path / "run"
    shutil.copytree(both_run, run)
    unmet = ["--max-kld", repr(best * 0.5)]
    assert quantforge_cli("card", str(run), *unmet).returncode == 0  # without the flag, a verdict is not a failure
    gated = quantforge_cli("card", str(run), *unmet, "--require-recommendation")
    assert gated.returncode == 4 and "no format meets the targets" in gated.stderr, gated.stderr
    assert "No format meets the targets" in (run / "card.md").read_text()  # the card is written all the same
    met = quantforge_cli(
        "card", str(run), "--max-ppl-increase", "1000", "--max-kld", "1000", "--require-recommendation"
    )
    assert met.returncode == 0, met.stderr


def test_a_push_keeps_every_file_of_one_type(both_run, tmp_path):
    """Issue 36: the three Q4_K_M files once shared a name, and the Hub repo kept the last. Each now has its own, with
    its own Modelfile; a pushed repo holds all six GGUFs byte for byte."""
    from hub_server import FakeHub

    token = "hf_quantforge_test_token_0123456789"
    home = tmp_path / "hf-home"
    env = {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": token}
    with FakeHub({}, token=token) as hub:
        result = quantforge_cli("push", str(both_run), "--to", "acme/tiny", env={**env, "HF_ENDPOINT": hub.endpoint})
        assert result.returncode == 0, result.stderr[-2000:]
        pushed = hub.pushed["acme/tiny-GGUF"]
    ggufs = sorted((both_run / "artifacts").glob("*/*.gguf"))
    assert len(ggufs) == 6 and len({g.name for g in ggufs}) == 6
    assert all(pushed[g.name] == g.read_bytes() for g in ggufs)
    labels = {"Q4_K_M", "Q4_K_M-imat", "Q4_K_M-autoround", "Q5_K_M", "Q5_K_M-imat", "Q5_K_M-autoround"}
    assert {name for name in pushed if name.startswith("Modelfile.")} == {f"Modelfile.{label}" for label in labels}
    for label in labels:  # each Modelfile loads its own file
        assert pushed[f"Modelfile.{label}"].decode().startswith(f"FROM ./tiny-llama-{label}.gguf\n")


def test_calibrated_files_load_and_generate_in_llama_cpp(both_run):
    from llama_cpp import Llama

    for gguf in sorted((both_run / "artifacts").glob("*@*/*.gguf")):
        llm = Llama(str(gguf), n_ctx=64, n_threads=2, verbose=False)
        assert llm("Hello", max_tokens=4, temperature=0)["usage"]["completion_tokens"] > 0
        llm.close()


def _imatrix_file(run: Path) -> Path:
    return next((run / "work").glob("*-imatrix.gguf"))


def test_imatrix_files_say_which_matrix_made_them_without_local_paths(both_run):
    from gguf import GGUFReader

    card = read_json(both_run / "card.json")
    entry = next(e for e in card["formats"] if e["key"] == "gguf-q4km@imatrix")
    samples, seqlen = (int(CALIBRATION[i]) for i in (1, 3))
    assert entry["quantize"]["quantizer"] == "llama.cpp llama-quantize --imatrix"
    assert (entry["quantize"]["calibration_samples"], entry["quantize"]["calibration_seqlen"]) == (samples, seqlen)
    fields = GGUFReader(next((both_run / "artifacts" / "gguf-q4km@imatrix").glob("*.gguf"))).fields
    value = lambda name: fields[name].contents()  # noqa: E731
    assert value("quantize.imatrix.file") == _imatrix_file(both_run).name  # a file name, not this machine's path
    assert "/" not in value("quantize.imatrix.dataset") and f"{samples}x{seqlen}" in value("quantize.imatrix.dataset")
    # re-tokenized text may come out a chunk short of the calibration set, never longer
    assert samples - 1 <= value("quantize.imatrix.chunks_count") <= samples
    plain = GGUFReader(next((both_run / "artifacts" / "gguf-q4km").glob("*.gguf"))).fields
    assert "quantize.imatrix.file" not in plain


def test_the_importance_matrix_is_the_mean_square_of_each_input_column(both_run, tiny_llama):
    """llama-imatrix's sums, recomputed in torch: per weight matrix, the sum over the calibration chunks' tokens of
    each input column's squared activation. Same tokens, same model: the two agree to float16 rounding."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = GGUFReader(_imatrix_file(both_run))
    assert reader.fields["general.type"].contents() == "imatrix"
    stored = {t.name: np.asarray(t.data, dtype=np.float64).reshape(-1) for t in reader.tensors}
    chunks = reader.fields["imatrix.chunk_count"].contents()
    seqlen = reader.fields["imatrix.chunk_size"].contents()
    assert stored["blk.0.attn_q.weight.counts"][0] == chunks * seqlen

    from quantforge.backends.llamacpp.imatrix import joined_calibration_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    calibration = np.load(both_run / "work" / "calibration.npy")
    ids = tokenizer(joined_calibration_text(tokenizer, calibration))["input_ids"][: chunks * seqlen]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sums: dict[str, torch.Tensor] = {}
    hooks = {
        "blk.0.attn_q.weight": model.model.layers[0].self_attn.q_proj,
        "blk.1.ffn_down.weight": model.model.layers[1].mlp.down_proj,
    }
    for name, module in hooks.items():
        module.register_forward_hook(
            lambda _m, args, _o, name=name: sums.__setitem__(
                name, sums.get(name, 0) + args[0].double().pow(2).sum((0, 1))
            )
        )
    with torch.no_grad():
        for chunk in np.asarray(ids).reshape(chunks, seqlen):
            model(torch.tensor(chunk[None]))
    for name in hooks:
        ours, theirs = sums[name].numpy(), stored[f"{name}.in_sum2"]
        np.testing.assert_allclose(theirs, ours, rtol=2e-2)
        assert np.corrcoef(ours, theirs)[0, 1] > 0.999
