"""Random-weight models with the real widths of each recipe and of the families the README lists, at two layers.

Small models hide large-model bugs: code paths switch on tensor size (chunked widening in lean.py, offload,
fallbacks), so each recipe's real hidden size, intermediate size, heads, KV heads, vocabulary, biases and tied or
untied embeddings go through every stage. Only the depth is cut (two decoder layers), so a 7B-shaped qwen2 is
1.56B parameters (3.1 GB in bf16) instead of 15 GB.

The weights are written tensor by tensor, seeded by the tensor's name, into safetensors shards of at most
``SHARD_BYTES``: the whole model is never in memory, and the same call gives the same bytes every time.

Widths are from each model's published config.json (Hub repo named in ``SHAPES``). Tokenizers are the ones the tiny
test models use (tiny_models.py): Qwen's for qwen2 shapes, SmolLM2's byte-level BPE for llama/qwen3/olmo2/MoE and
Phi, the Gemma-layout SentencePiece one for Gemma and Mistral; the vocabulary is the real model's size (llama.cpp's
converter pads the tokenizer's pieces up to it, as it does for real checkpoints whose tables are padded).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

SHARD_BYTES = 1 << 30  # as Hub checkpoints are cut (their shards are 2-5 GB; one tensor larger than this is alone)
LAYERS = 2
INIT_STD = 0.02  # transformers' initializer_range for these families


@dataclass(frozen=True)
class Shape:
    """A real model's widths: its transformers config class, the keyword arguments of its config.json that decide
    tensor shapes and arithmetic, the tokenizer kind (tiny_models) and the recipe it stands for (None: a family)."""

    hub_id: str
    config_class: str
    config: dict
    tokenizer: str
    recipe: str | None = None
    extra: dict = field(default_factory=dict)  # facts a test reads (e.g. a second recipe with the same shape)


QWEN_TOKENS = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
SMOLLM_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
SP_TOKENS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)

SHAPES: dict[str, Shape] = {
    # Recipes (recipes/*.yaml): the shapes their size: blocks describe.
    "qwen2.5-7b": Shape(
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            use_sliding_window=False,
            **QWEN_TOKENS,
        ),
        "qwen",
        recipe="qwen2.5-7b",
    ),
    "llama-3.1-8b": Shape(
        "meta-llama/Llama-3.1-8B-Instruct",
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            **SMOLLM_TOKENS,
        ),
        "smollm",
        recipe="llama-3.1-8b",
    ),
    "qwen2.5-0.5b": Shape(  # Qwen2.5-0.5B-Instruct and Qwen2.5-Coder-0.5B-Instruct share every width
        "Qwen/Qwen2.5-0.5B-Instruct",
        "Qwen2Config",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            use_sliding_window=False,
            **QWEN_TOKENS,
        ),
        "qwen",
        recipe="qwen2.5-0.5b",
        extra={"also": "qwen2.5-coder-0.5b"},
    ),
    "smollm2-135m": Shape(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "LlamaConfig",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            **SMOLLM_TOKENS,
        ),
        "smollm",
        recipe="smollm2-135m",
    ),
    # The other families the README lists, one real size each.
    "gemma-3-1b": Shape(
        "google/gemma-3-1b-it",
        "Gemma3TextConfig",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            sliding_window=512,
            query_pre_attn_scalar=256,
            **SP_TOKENS,
        ),
        "sp",
    ),
    "phi-4-mini": Shape(
        "microsoft/Phi-4-mini-instruct",
        "Phi3Config",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=200064,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            partial_rotary_factor=0.75,
            rope_theta=10000.0,
            sliding_window=None,
            **SMOLLM_TOKENS,
        ),
        "gpt2",
    ),
    "mistral-7b": Shape(
        "mistralai/Mistral-7B-Instruct-v0.3",
        "MistralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32768,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            sliding_window=None,
            **SP_TOKENS,
        ),
        "sp",
    ),
    "olmo-2-1b": Shape(
        "allenai/OLMo-2-0425-1B-Instruct",
        "Olmo2Config",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=100352,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            **SMOLLM_TOKENS,
        ),
        "smollm",
    ),
    "qwen3-4b": Shape(
        "Qwen/Qwen3-4B",
        "Qwen3Config",
        dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            use_sliding_window=False,
            **SMOLLM_TOKENS,
        ),
        "smollm",
    ),
    "qwen1.5-moe-a2.7b": Shape(
        "Qwen/Qwen1.5-MoE-A2.7B-Chat",
        "Qwen2MoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=151936,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=8192,
            rope_theta=1000000.0,
            use_sliding_window=False,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            decoder_sparse_step=1,
            **SMOLLM_TOKENS,
        ),
        "smollm",
    ),
}


def make_config(shape: Shape, layers: int = LAYERS):
    import transformers

    return getattr(transformers, shape.config_class)(
        **shape.config, num_hidden_layers=layers, initializer_range=INIT_STD
    )


def _tensor_names(config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the checkpoint stores (name -> shape, dtype name), from a model skeleton on the meta device.

    transformers 5 keeps a mixture of experts' projections fused ([experts, out, in]); its checkpoints, like the
    Hub's, store one Linear per expert, and transformers splits or fuses on load: those are named as checkpoints
    name them.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = getattr(config, "tie_word_embeddings", False)
    names = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        experts, _, leaf = name.rpartition(".")
        if experts.endswith(".experts") and leaf in ("gate_up_proj", "down_proj") and tensor.dim() == 3:
            count, out, inner = tensor.shape
            for i in range(count):
                if leaf == "gate_up_proj":
                    for part in ("gate_proj", "up_proj"):
                        names[f"{experts}.{i}.{part}.weight"] = ((out // 2, inner), "bfloat16")
                else:
                    names[f"{experts}.{i}.down_proj.weight"] = ((out, inner), "bfloat16")
            continue
        names[name] = (tuple(tensor.shape), "bfloat16")
    return names


# Normal values are drawn for at most this many elements of a tensor and repeated to fill it: drawing 1.5B of them
# took a minute here, and a shape test needs real sizes, not fresh randomness in every row of a 545M-element table.
DRAWN_ELEMENTS = 1 << 24


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, model_type: str):
    import torch

    if name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm"):
        # Gemma's RMSNorm scales by 1 + weight: a zero weight is a unit scale there, as ones are elsewhere
        return (torch.zeros(shape) if model_type.startswith("gemma") else torch.ones(shape)).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    count = _count(shape)
    drawn = (torch.randn(min(count, DRAWN_ELEMENTS), generator=generator) * INIT_STD).to(torch.bfloat16)
    return drawn.repeat(-(-count // drawn.numel()))[:count].view(shape)


def write_random_model(name: str, out: Path, *, layers: int = LAYERS, seed: int = 0) -> Path:
    """The model ``SHAPES[name]`` with ``layers`` decoder layers and random weights, as a Hub-style sharded
    safetensors folder with its tokenizer. Returns ``out``."""
    from safetensors.torch import save_file
    from tiny_models import tokenizer_files_into

    shape = SHAPES[name]
    config = make_config(shape, layers)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _tensor_names(config)
    shards: list[list[str]] = [[]]
    size = 0
    for tensor, (dims, _) in tensors.items():
        nbytes = 2 * _count(dims)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    weight_map, total = {}, 0
    for index, names in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        shard = {t: _random_tensor(t, tensors[t][0], seed, config.model_type) for t in names}
        save_file(shard, out / file, metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in shard.values())
        weight_map.update(dict.fromkeys(names, file))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    from transformers import AutoModelForCausalLM

    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]  # as Hub configs name it
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    tokenizer_files_into(shape.tokenizer, out)
    return out


def _count(dims: tuple[int, ...]) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def parameters(name: str, layers: int = LAYERS) -> int:
    """The parameters the checkpoint of ``SHAPES[name]`` stores at ``layers`` layers (no weights made)."""
    return sum(_count(dims) for dims, _ in _tensor_names(make_config(SHAPES[name], layers)).values())
