"""The GGUF ladder GGUF publishers ship (issue 37): Q4_0, IQ4_XS, Q3_K_M, Q2_K and the IQ3/IQ2 types that need an
importance matrix, asked by llama.cpp's own names, made by llama.cpp's quantizer, measured from disk in llama.cpp.

Two architectures: the tiny llama (SmolLM2's tokenizer, tied embeddings) and the tiny Gemma 3 (a SentencePiece
tokenizer that adds BOS, sliding-window layers). One build each.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from conftest import CALIBRATION, WIKITEXT, build_run, quantforge_cli, read_json

from quantforge.backends.llamacpp import tensor_types

pytestmark = pytest.mark.slow  # two builds of nine GGUF types (about a minute each)

# As users type them (llama.cpp's names, in any case), and the format each is.
ASKED = {
    "Q4_0": "gguf-q4_0",
    "iq4_xs": "gguf-iq4xs",
    "Q3_K_M": "gguf-q3km",
    "q2_k": "gguf-q2k",
    "IQ3_M": "gguf-iq3m",
    "IQ3_XXS": "gguf-iq3xxs",
    "IQ2_M": "gguf-iq2m",
    "IQ2_XS": "gguf-iq2xs",
    "IQ2_XXS": "gguf-iq2xxs",
}
# The type llama.cpp's quantizer gives most of the decoder's weight matrices under each file type (its own mixing
# rules: IQ2_M is mostly IQ2_S, IQ3_M mostly IQ3_S). Seen on both models.
MAIN_TYPE = {
    "gguf-q4_0": "Q4_0",
    "gguf-iq4xs": "IQ4_XS",
    "gguf-q3km": "Q3_K",
    "gguf-q2k": "Q2_K",
    "gguf-iq3m": "IQ3_S",
    "gguf-iq3xxs": "IQ3_XXS",
    "gguf-iq2m": "IQ2_S",
    "gguf-iq2xs": "IQ2_XS",
    "gguf-iq2xxs": "IQ2_XXS",
}
LADDER_ARGS = [
    *("--eval-text", str(WIKITEXT), "--ppl-context", "128", "--ppl-windows", "4", "--threads", "2", "--no-speed"),
    *CALIBRATION,
    *("--calibration", str(WIKITEXT.parents[1] / "calibration" / "c4-en-train-00000-sample.jsonl")),
]


@pytest.fixture(scope="module")
def ladder_run(tiny_model, tmp_path_factory):
    runs = {}

    def run(kind: str):
        if kind not in runs:
            out = tmp_path_factory.mktemp("ladder") / kind
            runs[kind] = build_run(tiny_model(kind), out, "--formats", ",".join(ASKED), *LADDER_ARGS)
        return runs[kind]

    return run


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_ladder_is_made_by_llama_cpp_and_measured_from_disk(kind, ladder_run):
    run = ladder_run(kind)
    card = read_json(run / "card.json")
    entries = {entry["key"]: entry for entry in card["formats"]}
    assert set(entries) == set(ASKED.values())  # llama.cpp's names resolved to quantforge's formats
    for key, entry in entries.items():
        gguf = next((run / entry["artifact"]).glob("*.gguf"))
        decoder = Counter(t for name, t in tensor_types(gguf).items() if name.startswith("blk.") and "norm" not in name)
        assert decoder.most_common(1)[0][0] == MAIN_TYPE[key], (key, decoder)
        assert entry["how"]["runtime"] == "llama.cpp"
        metrics = entry["metrics"]
        assert math.isfinite(metrics["perplexity"]) and metrics["tokens_scored"] == card["reference"]["tokens_scored"]
        interval = entry["intervals"]["kld_mean"]
        assert interval["low"] <= metrics["kld_mean"] <= interval["high"]
        # Measured (2026-12-07): Gemma 3 from IQ4_XS 0.0055 to IQ2_XXS 0.080; the llama (flat distributions of random
        # weights and a tied 49k embedding) from IQ4_XS 0.095 to IQ2_XXS 0.93. A broken file sits far above.
        assert 0 < metrics["kld_mean"] < 3.0, (key, metrics)
    # The IQ3/IQ2 types come from the importance-matrix backend, made once from the calibration set; the others
    # from llama.cpp's plain quantizer.
    stages = read_json(run / "run.json")["stages"]
    assert "intermediate/imatrix" in stages
    for key in ("gguf-iq3m", "gguf-iq3xxs", "gguf-iq2m", "gguf-iq2xs", "gguf-iq2xxs"):
        assert entries[key]["backend"] == "imatrix" and next((run / "artifacts" / key).glob("*-imat.gguf"))
    assert entries["gguf-q4_0"]["backend"] == "llamacpp"
    # The 2-bit files are the smallest; Q4_0 and IQ4_XS the largest of the ladder.
    bits = {key: entry["bits_per_weight"] for key, entry in entries.items()}
    assert max(bits["gguf-iq2xxs"], bits["gguf-iq2xs"]) < min(bits["gguf-q4_0"], bits["gguf-iq4xs"])


def test_a_type_that_needs_an_importance_matrix_is_refused_without_one(tiny_llama, tmp_path):
    result = quantforge_cli("build", str(tiny_llama), "--out", str(tmp_path / "run"), "--formats", "IQ2_XXS",
                            "--backend", "llamacpp")  # fmt: skip
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "backend 'llamacpp' does not make gguf-iq2xxs" in last and "importance matrix" in last, result.stderr
    assert not (tmp_path / "run" / "artifacts").exists()
