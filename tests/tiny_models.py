"""Tiny random models with real tokenizers, for exercising every format in seconds.

Widths are multiples of 256 so K-quant super-blocks and group size 128 apply without fallback. The tokenizer is
SmolLM2's (a real GPT-2 style BPE with 49152 tokens), taken from the bundled model's folder.
"""

from __future__ import annotations

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
    vocab_size=49152,
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


def build_tiny_model(kind: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    configs = {
        "llama": lambda: LlamaConfig(**COMMON, rope_theta=10000.0),
        "qwen2": lambda: Qwen2Config(**COMMON, rope_theta=1000000.0, use_sliding_window=False),
        "qwen3": lambda: Qwen3Config(**COMMON, rope_theta=1000000.0, use_sliding_window=False),
    }
    torch.manual_seed(seed)
    config = configs[kind]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
