"""Tiny random models with real tokenizers, one per architecture family, for exercising every format in seconds.

Widths are multiples of 256 so K-quant super-blocks and group size 128 apply without fallback. Three real tokenizers:
- SmolLM2's (a GPT-2 style byte-level BPE with 49152 tokens, which llama.cpp's converter recognises by its
  pre-tokenizer hash), taken from the bundled model's folder; it adds no BOS.
- Qwen2.5's (151,936 ids), from the bundled Qwen2.5-Coder GGUF, for qwen2: transformers 5 always loads a qwen2
  model's tokenizer as Qwen2Tokenizer, with Qwen's own splitting rules, whatever tokenizer files the folder has.
- A SentencePiece BPE with byte fallback in the layout of Gemma's (``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``; BOS
  in front of every text), trained here in a fraction of a second on Python's pydoc topics, for the families whose
  real tokenizers are SentencePiece models that add BOS (Gemma, Mistral/Llama 2), so that BOS handling is exercised
  as those models need it. llama.cpp reads it from ``tokenizer.model``, transformers from the same file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=49152,  # SmolLM2's tokenizer; the SentencePiece one uses SP_VOCAB_SIZE
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    # Larger than the usual 0.02 so the random model's next-token distributions are peaked enough for
    # quantization error to show in KL divergence and perplexity.
    initializer_range=0.08,
)


def _configs() -> dict:
    """kind -> (config factory, tokenizer: "smollm", "gpt2" (SmolLM2's, declared as GPT2Tokenizer), "sp" or "qwen").
    Imported late: transformers is heavy."""
    import transformers as tf

    no_window = dict(use_sliding_window=False)
    sp = dict(vocab_size=SP_VOCAB_SIZE, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    qwen = dict(vocab_size=151936, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    return {
        "llama": (lambda: tf.LlamaConfig(**COMMON, rope_theta=10000.0), "smollm"),
        "mistral": (lambda: tf.MistralConfig(**{**COMMON, **sp}, rope_theta=10000.0, sliding_window=None), "sp"),
        "qwen2": (lambda: tf.Qwen2Config(**{**COMMON, **qwen}, rope_theta=1000000.0, **no_window), "qwen"),
        "qwen3": (lambda: tf.Qwen3Config(**COMMON, rope_theta=1000000.0, **no_window), "smollm"),
        # Gemma 3: scaled embeddings, sandwich norms, q/k norms, sliding-window and global layers, BOS always.
        "gemma3": (
            lambda: tf.Gemma3TextConfig(**{**COMMON, **sp}, sliding_window=64, query_pre_attn_scalar=64),
            "sp",
        ),
        # Phi-3: fused qkv_proj and gate_up_proj.
        "phi3": (
            lambda: tf.Phi3Config(**{**COMMON, "num_key_value_heads": 4}, rope_theta=10000.0, sliding_window=None),
            "gpt2",  # as Phi-4-mini: a byte-level BPE declared as GPT2Tokenizer
        ),
        # A mixture of experts with a shared expert.
        "qwen2_moe": (
            lambda: tf.Qwen2MoeConfig(
                **{**COMMON, "tie_word_embeddings": False},  # llama.cpp's qwen2moe loader needs its own output
                rope_theta=1000000.0,
                **no_window,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=256,
                shared_expert_intermediate_size=512,
                decoder_sparse_step=1,
            ),
            "smollm",
        ),
        # OLMo 2: norms after attention and MLP, q/k norms over the whole projection.
        # llama.cpp's olmo2 loader needs an output tensor of its own, as OLMo 2 releases have.
        "olmo2": (lambda: tf.Olmo2Config(**{**COMMON, "tie_word_embeddings": False}, rope_theta=10000.0), "smollm"),
    }


def folder_name(kind: str) -> str:
    # llama.cpp gives Phi-3's special tokens extra attributes when the model's *name* contains "phi3" or "phi-3",
    # and that needs Phi-3's own "</s>" in the vocabulary; the Phi-4-mini-like test model must not be named so.
    return "tiny-phi4-mini-like" if kind == "phi3" else f"tiny-{kind}"


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen2_moe", "olmo2")


SP_VOCAB_SIZE = 4352  # the 4096 pieces, transformers' added <mask>, padding to a multiple of 256
SP_SPECIALS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}


def write_sentencepiece_tokenizer(folder: Path) -> None:
    """A Gemma-layout SentencePiece BPE tokenizer (tokenizer.model + tokenizer.json), the same bytes every time."""
    import io
    from pydoc_data.topics import topics

    import sentencepiece
    from transformers import AutoTokenizer

    lines = [line for key in sorted(topics) for line in topics[key].splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=4096,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        character_coverage=1.0,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        **{f"{name.split('_')[0]}_id": index for index, name in enumerate(SP_SPECIALS)},
        **{f"{name.split('_')[0]}_piece": piece for name, piece in SP_SPECIALS.items()},
        num_threads=1,
        minloglevel=2,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False, **SP_SPECIALS}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)  # adds tokenizer.json, as Hub repos ship it


def build_tiny_model(kind: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """``tokenizer_dir``: SmolLM2's folder (for the kinds that use its tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    make_config, tokenizer = _configs()[kind]
    torch.manual_seed(seed)
    config = make_config()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)  # as checkpoints on the Hub are stored
    tokenizer_files_into(tokenizer, out, tokenizer_dir)
    return out


def tokenizer_files_into(tokenizer: str, out: Path, smollm_dir: Path | None = None) -> None:
    """Write the tokenizer of kind ``tokenizer`` ("smollm", "gpt2", "sp" or "qwen") into the model folder ``out``."""
    if tokenizer == "sp":
        write_sentencepiece_tokenizer(out)
        return
    if tokenizer == "qwen":
        from quantforge.source import bundled_tokenizer

        tokenizer_dir = bundled_tokenizer("qwen2.5-coder-0.5b")
    else:
        from quantforge.source import BUNDLED

        tokenizer_dir = smollm_dir or BUNDLED["smollm2-135m"](lambda message: None)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    if tokenizer == "gpt2":
        # llama.cpp's phi3 converter reads the vocabulary as GPT-2 BPE only when the tokenizer says it is one.
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
