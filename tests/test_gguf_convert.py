"""GGUF conversion through llama.cpp's own converter (every test architecture's F16 file is checked against
transformers in test_architectures.py, through the pipeline)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quantforge.backends.llamacpp import LlamaCppRunner, gguf_adds_bos, quantize_gguf, tensor_types
from quantforge.backends.llamacpp.convert import architecture_problem, convert_hf_to_gguf, supported_architectures
from quantforge.errors import QuantforgeError
from quantforge.evaluate import bos_token_id, log_softmax
from quantforge.runners import TorchRunner

# "The capital of France is Paris. In 2024, 12345 ..." in SmolLM2's tokenizer (every tiny model uses it).
PROMPT_IDS = np.array(
    [504, 3458, 282, 4649, 314, 7042, 30, 378, 1345, 282, 260, 3767, 10215, 314, 1182, 216, 34, 32, 34, 36, 28, 284]
    + [357, 2744, 281, 253, 1345, 30, 1],
    dtype=np.int32,
)


def _kl(reference_logits: np.ndarray, logits: np.ndarray) -> float:
    p, q = log_softmax(reference_logits), log_softmax(logits)
    return float(np.mean((np.exp(p) * (p - q)).sum(axis=-1)))


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


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_tokenizer_and_bos_round_trip(kind, tiny_model, tmp_path):
    """llama.cpp tokenizes with the converted metadata exactly as the HF tokenizer does, digits, specials and the
    BOS the tokenizer adds (none for SmolLM2's, always for the Gemma-style copy) included."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    folder = tiny_model(kind)
    out = tmp_path / "tiny.gguf"
    convert_hf_to_gguf(folder, out)
    text = "In 2024, 12345 apples cost $3.50 — naïve café 🚀 <|im_start|>user"
    expected = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    llm = Llama(str(out), vocab_only=True, verbose=False)
    adds_bos = bos_token_id(folder) is not None
    assert adds_bos == (kind == "gemma3")
    assert llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == str(adds_bos).lower()
    assert gguf_adds_bos(out) == adds_bos  # what the Ollama Modelfile's template is written for
    if adds_bos:  # the SentencePiece tokenizer has no chat tokens
        text = text.replace(" <|im_start|>user", "")
        expected = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=adds_bos, special=True) == expected


def test_the_header_walk_reads_every_scalar_metadata_value_as_gguf_does(tiny_run):
    """quantforge's header walk (milliseconds) against gguf's own reader (seconds) on the bundled model's GGUF and a
    quantized one of the pipeline's: every scalar and string value alike, arrays and absent keys read as None."""
    from gguf import GGUFReader, GGUFValueType

    from quantforge.artifacts import gguf_metadata_value
    from quantforge.source import _smollm2_gguf

    for path in [next((tiny_run / "artifacts" / "gguf-q4km").glob("*.gguf")), _smollm2_gguf()]:
        fields = GGUFReader(path).fields
        scalars = {k: f for k, f in fields.items() if not k.startswith("GGUF.") and f.types[0] != GGUFValueType.ARRAY}
        assert len(scalars) > 10
        for key, field in scalars.items():
            assert gguf_metadata_value(path, key) == field.contents(), key
        assert gguf_metadata_value(path, "tokenizer.ggml.tokens") is None
        assert gguf_metadata_value(path, "no.such.key") is None


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


def test_supported_architectures_come_from_the_converter():
    known = supported_architectures()
    assert len(known) > 100
    for name in ("LlamaForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Qwen2MoeForCausalLM"):
        assert name in known and architecture_problem(name) is None
    assert "is not one llama.cpp's GGUF converter knows" in architecture_problem("MadeUpForCausalLM")


def test_unsupported_architecture_is_a_clear_error(tiny_llama, tmp_path):
    folder = tmp_path / "unknown"
    folder.mkdir()
    for file in tiny_llama.iterdir():
        (folder / file.name).symlink_to(file)
    (folder / "config.json").unlink()
    config = json.loads((tiny_llama / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        QuantforgeError, match=r"GGUF converter \(llama-cpp-python [0-9.]+\) failed: .*MadeUpForCausalLM"
    ):
        convert_hf_to_gguf(folder, tmp_path / "x.gguf", log_path=tmp_path / "convert.log")
    assert not (tmp_path / "x.gguf").exists()


def test_the_evaluation_decodes_a_window_in_blocks_with_the_same_figures(tiny_run, monkeypatch):
    """llama.cpp decodes an evaluation window a block of positions at a time (its buffers then hold a block's logits,
    not the window's): the logits equal one whole-window decode's bit for bit, and every figure computed from the
    blocks equals the figure computed from the whole array, row chunks straddling the blocks' edges included."""
    import quantforge.backends.llamacpp as llamacpp
    import quantforge.evaluate as evaluate

    f16, q4 = (next((tiny_run / "artifacts" / key).glob("*.gguf")) for key in ("gguf-f16", "gguf-q4km"))
    window = np.random.default_rng(0).integers(0, 4000, 128).astype(np.int32)

    def decoded(path, rows):
        monkeypatch.setattr(llamacpp, "LOGIT_ROWS", rows)
        runner = LlamaCppRunner(path, context=128, threads=2)
        try:
            whole = runner.logits(window)
            blocks = [block.copy() for block in runner.scored_logits(window)]
        finally:
            runner.close()
        return whole, blocks

    reference, _ = decoded(f16, 128)
    whole, _ = decoded(q4, 128)
    blocked, blocks = decoded(q4, 48)
    assert [len(b) for b in blocks] == [48, 48, 31]  # the last position is not scored
    assert np.array_equal(whole, blocked) and np.array_equal(whole[:-1], np.concatenate(blocks))

    monkeypatch.setattr(evaluate, "ROW_CHUNK", 5)
    ref_whole = evaluate.reference_window(reference, window)
    ref_blocks = evaluate.reference_window(iter(np.array_split(reference[:-1], 3)), window)
    for name in evaluate.REFERENCE_FIELDS:
        assert np.array_equal(getattr(ref_whole, name), getattr(ref_blocks, name)), name
    from_whole = evaluate.compare_window(whole, window, ref_whole)
    from_blocks = evaluate.compare_window(iter(blocks), window, ref_whole)
    assert from_whole["kld"].mean() > 0
    for name, values in from_whole.items():
        assert np.array_equal(values, from_blocks[name]), name
    with pytest.raises(ValueError, match="96 positions, not the 127 scored"):
        evaluate.compare_window(iter(blocks[:2]), window, ref_whole)
