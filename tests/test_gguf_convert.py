"""The HF -> GGUF converter, checked by running what it wrote in llama.cpp against transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quantforge.backends.llamacpp import LlamaCppRunner, quantize_gguf, tensor_types
from quantforge.errors import QuantforgeError
from quantforge.evaluate import log_softmax
from quantforge.gguf_convert import convert_hf_to_gguf
from quantforge.runners import TorchRunner

PROMPT_IDS = np.array(
    [
        504,
        3458,
        282,
        4649,
        314,
        7042,
        30,
        378,
        1345,
        282,
        260,
        3767,
        10215,
        314,
        1182,
        216,
        34,
        32,
        34,
        36,
        28,
        284,
        357,
        2744,
        281,
        253,
        1345,
        30,
        1,
    ],
    dtype=np.int32,
)


def _kl(reference_logits: np.ndarray, logits: np.ndarray) -> float:
    p, q = log_softmax(reference_logits), log_softmax(logits)
    return float(np.mean((np.exp(p) * (p - q)).sum(axis=-1)))


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_f16_gguf_matches_transformers(kind, request, tmp_path):
    """Same next-token distributions from llama.cpp on our F16 file as from transformers on the folder.

    This is what catches a wrong q/k permutation, a missing bias or a wrong norm epsilon: each of those moves
    the logits far more than F16 rounding does.
    """
    folder = request.getfixturevalue(kind)
    out = tmp_path / "model-f16.gguf"
    facts = convert_hf_to_gguf(folder, out, outtype="f16")
    assert facts["pre"] == "smollm" and facts["tokenizer"] == "gpt2"
    reference = TorchRunner.from_folder(folder, threads=2).logits(PROMPT_IDS)
    runner = LlamaCppRunner(out, context=64, threads=2)
    try:
        ours = runner.logits(PROMPT_IDS)
    finally:
        runner.close()
    assert ours.shape == reference.shape
    assert _kl(reference, ours) < 1e-4
    assert np.mean(ours.argmax(-1) == reference.argmax(-1)) > 0.95


def test_f16_gguf_matches_transformers_on_smollm2(smollm2_dir, tmp_path):
    out = tmp_path / "smollm2-f16.gguf"
    convert_hf_to_gguf(smollm2_dir, out, outtype="f16")
    reference = TorchRunner.from_folder(smollm2_dir, threads=2).logits(PROMPT_IDS)
    runner = LlamaCppRunner(out, context=64, threads=2)
    try:
        ours = runner.logits(PROMPT_IDS)
        text = runner.llm.create_chat_completion(
            [{"role": "user", "content": "What is the capital of France?"}], max_tokens=12, temperature=0
        )["choices"][0]["message"]["content"]
    finally:
        runner.close()
    assert _kl(reference, ours) < 1e-3
    assert "Paris" in text


def test_tokenizer_metadata_round_trips(tiny_llama, tmp_path):
    """llama.cpp tokenizes with the metadata we wrote exactly as the HF tokenizer does, digits included."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    out = tmp_path / "tiny.gguf"
    convert_hf_to_gguf(tiny_llama, out)
    text = "In 2024, 12345 apples cost $3.50 — naïve café 🚀 <|im_start|>user"
    expected = AutoTokenizer.from_pretrained(tiny_llama)(text, add_special_tokens=False)["input_ids"]
    llm = Llama(str(out), vocab_only=True, verbose=False)
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == expected


def test_k_quants_apply_without_fallback_on_multiple_of_256_widths(tiny_llama, tmp_path):
    f16 = tmp_path / "tiny-f16.gguf"
    convert_hf_to_gguf(tiny_llama, f16)
    q4 = tmp_path / "tiny-q4km.gguf"
    facts = quantize_gguf(f16, q4, 15, 2, tmp_path / "q.log")
    types = tensor_types(q4)
    assert facts["fallback_tensors"] == 0
    assert types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    # Q4_K_M keeps the tied embedding/output tensor at higher precision.
    assert types["token_embd.weight"] == "Q6_K"


def test_unsupported_architecture_is_a_clear_error(tiny_llama, tmp_path):
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantforgeError, match="GPT2LMHeadModel is not supported for GGUF"):
        convert_hf_to_gguf(folder, tmp_path / "x.gguf")
