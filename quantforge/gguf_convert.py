"""Hugging Face folder -> GGUF (F16, BF16 or F32) on the ``gguf`` package.

Written for the decoder-only architectures llama.cpp runs as ``llama`` (Llama, Mistral), ``qwen2`` and ``qwen3``.
The goal is a file whose tensors are byte-identical to llama.cpp's own converter and whose metadata matches it
(``scripts/check_gguf_parity.py`` checks that), so that llama.cpp's quantizer sees the same input either way.

Facts this relies on:
- llama.cpp's ``llama`` architecture applies RoPE to interleaved pairs, HF Llama to rotate-half halves: the rows of
  q_proj and k_proj are permuted so that the two agree. Qwen2/Qwen3 use the NeoX layout in llama.cpp: no permutation.
- 1-D tensors and norms stay F32 (llama.cpp's kernels expect that); 2-D weights take the output type.
- The BPE pre-tokenizer is named in ``tokenizer.ggml.pre``; llama.cpp picks its splitting regex by that name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .errors import QuantforgeError

OUT_TYPES = ("f16", "bf16", "f32")


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: str  # name in gguf.MODEL_ARCH_NAMES
    permute_qk: bool  # HF rotate-half -> llama.cpp interleaved RoPE
    writes_vocab_size: bool  # llama.cpp's llama converter writes {arch}.vocab_size and rope.dimension_count


ARCHITECTURES = {
    "LlamaForCausalLM": ArchSpec("llama", permute_qk=True, writes_vocab_size=True),
    "MistralForCausalLM": ArchSpec("llama", permute_qk=True, writes_vocab_size=True),
    "Qwen2ForCausalLM": ArchSpec("qwen2", permute_qk=False, writes_vocab_size=False),
    "Qwen3ForCausalLM": ArchSpec("qwen3", permute_qk=False, writes_vocab_size=False),
}


def architecture_problem(config: dict) -> str | None:
    """Why this model cannot be converted, or None."""
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else "unknown"
    if arch not in ARCHITECTURES:
        return f"architecture {arch} is not supported for GGUF conversion (supported: {', '.join(ARCHITECTURES)})"
    return None


def _permute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder each head's rows from [first halves | second halves] to interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _read_tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the folder's safetensors files as float32/float16 numpy arrays."""
    import torch
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if tensor.dtype not in (torch.float16, torch.float32):
                    tensor = tensor.to(torch.float32)
                yield name, tensor.numpy()


# ----------------------------------------------------------------------------------------------- tokenizer


def _pre_tokenizer_name(tokenizer_json: dict, gguf_arch: str) -> str:
    """llama.cpp's name for this tokenizer's pre-tokenization rules, read from tokenizer.json's pre_tokenizer.

    llama.cpp identifies it by hashing the tokenization of a test string; the structure of the pre_tokenizer
    section decides the same question for the families we support, without running the tokenizer.
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    split_patterns = [(step.get("pattern") or {}).get("Regex", "") for step in steps if step.get("type") == "Split"]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"  # GPT-2 rules with every digit split on its own (SmolLM, SmolLM2)
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    for pattern in split_patterns:
        if r"\p{N}{1,3}" in pattern:
            return "llama-bpe"  # Llama 3 and the many tokenizers that reuse its regex
        if r"\p{N}" in pattern and gguf_arch in ("qwen2", "qwen3"):
            return "qwen2"
    raise QuantforgeError(
        f"the tokenizer's pre-tokenizer ({'+'.join(k or '?' for k in kinds)}) is not one quantforge can name "
        "for llama.cpp; convert this model with llama.cpp's convert_hf_to_gguf.py instead"
    )


def _is_byte_level(tokenizer_json: dict) -> bool:
    """GPT-2 style byte-level BPE (as opposed to SentencePiece-style BPE with byte fallback)."""
    return '"ByteLevel"' in json.dumps(tokenizer_json.get("pre_tokenizer"))


def _looks_special(text: str) -> bool:
    return (text.startswith("<|") and text.endswith("|>")) or (
        text.startswith("<") and text.endswith(">") and text[1:-1].isupper()
    )


def _gpt2_vocab(folder: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token texts and types in id order, padded to the model's vocabulary size as llama.cpp expects."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise QuantforgeError(f"the tokenizer has ids beyond the model's vocab_size {vocab_size}")
    by_id = {index: text for text, index in vocab.items()}
    added = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        text = by_id.get(index)
        if text is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif text in added:
            info = added_decoder[index]
            if not info.normalized:
                # llama.cpp treats added tokens as already normalized: store the text the tokenizer round-trips to.
                text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
            if info.special or _looks_special(text):
                types.append(gguf.TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _adds_bos(folder: Path) -> bool:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def _write_vocab(writer, folder: Path, config: dict, spec: ArchSpec) -> dict:
    import gguf

    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.exists():
        raise QuantforgeError(f"{folder} has no tokenizer.json; GGUF conversion needs the model's fast tokenizer")
    tokenizer_json = json.loads(tokenizer_path.read_text())
    model = tokenizer_json.get("model", {})
    vocab_size = int(config["vocab_size"])
    if model.get("type") == "BPE" and model.get("byte_fallback") and not _is_byte_level(tokenizer_json):
        # SentencePiece-style BPE (Llama 2, Mistral): llama.cpp's "llama" tokenizer with scores.
        hf_vocab = gguf.LlamaHfVocab(folder)
        tokens, scores, types = [], [], []
        for text, score, kind in hf_vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(kind)
        for index in range(len(tokens), vocab_size):
            tokens.append(f"[PAD{index}]".encode())
            scores.append(-1000.0)
            types.append(gguf.TokenType.UNUSED)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        pre, load_merges = "default", False
    elif model.get("type") == "BPE":
        pre = _pre_tokenizer_name(tokenizer_json, spec.gguf_arch)
        tokens, types = _gpt2_vocab(folder, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        load_merges = True
    else:
        raise QuantforgeError(f"tokenizer model type {model.get('type')!r} is not supported for GGUF conversion")
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if tokenizer_config.get("add_prefix_space") is not None:
        writer.add_add_space_prefix(bool(tokenizer_config["add_prefix_space"]))
    special = gguf.SpecialVocab(folder, load_merges=load_merges, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    add_bos = _adds_bos(folder)
    if "bos" not in special.add_special_token:
        # gguf's helper does not read this from transformers-5 tokenizer configs: state it from the tokenizer.
        writer.add_add_bos_token(add_bos)
    return {"tokenizer": "llama" if not load_merges else "gpt2", "pre": pre, "add_bos": add_bos}


# ----------------------------------------------------------------------------------------------- hyperparameters


def _write_hparams(writer, config: dict, spec: ArchSpec, file_type: int) -> None:
    import gguf

    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    writer.add_block_count(text["num_hidden_layers"])
    if text.get("max_position_embeddings"):
        writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(text.get("num_key_value_heads", heads))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if rope_type == "linear" and factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type not in (None, "default", "llama3"):
        raise QuantforgeError(f"RoPE scaling type {rope_type!r} is not supported for GGUF conversion")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(theta)
    if text.get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    if text.get("head_dim") is not None:
        writer.add_key_length(text["head_dim"])
        writer.add_value_length(text["head_dim"])
    writer.add_file_type(file_type)
    if spec.writes_vocab_size:
        writer.add_vocab_size(text["vocab_size"])
        writer.add_rope_dimension_count(text.get("head_dim") or text["hidden_size"] // heads)


def _llama3_rope_factors(config: dict) -> np.ndarray | None:
    """Llama 3.1's frequency-dependent RoPE scaling, which llama.cpp reads from a ``rope_freqs`` tensor."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) != "llama3":
        return None
    base = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


# ----------------------------------------------------------------------------------------------- convert


def convert_hf_to_gguf(
    folder: Path,
    out_path: Path,
    *,
    outtype: str = "f16",
    name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Write ``out_path`` (a .gguf) from the HF folder; return facts about what was written."""
    import gguf

    if outtype not in OUT_TYPES:
        raise QuantforgeError(f"unknown GGUF output type {outtype!r}; choose one of {', '.join(OUT_TYPES)}")
    config = json.loads((folder / "config.json").read_text())
    problem = architecture_problem(config)
    if problem:
        raise QuantforgeError(problem)
    spec = ARCHITECTURES[config["architectures"][0]]
    text = config.get("text_config") or config
    qtype = {
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "f32": gguf.GGMLQuantizationType.F32,
    }[outtype]
    file_type = {
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "f32": gguf.LlamaFileType.ALL_F32,
    }[outtype]
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == spec.gguf_arch)
    n_blocks = text["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(arch, n_blocks)
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", heads)

    writer = gguf.GGUFWriter(str(out_path), spec.gguf_arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or folder.name)
    _write_hparams(writer, config, spec, int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab_facts = _write_vocab(writer, folder, config, spec)

    n_tensors = 0
    rope_factors = _llama3_rope_factors(config)
    if rope_factors is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_factors)
        n_tensors += 1
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    for hf_name, data in _read_tensors(folder):
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses token_embd when there is no output tensor
        new_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise QuantforgeError(
                f"tensor {hf_name} has no GGUF name for {spec.gguf_arch}; the model is not a "
                f"plain {config['architectures'][0]}"
            )
        if spec.permute_qk and hf_name.endswith("q_proj.weight"):
            data = _permute_rope_rows(data, heads)
        elif spec.permute_qk and hf_name.endswith("k_proj.weight"):
            data = _permute_rope_rows(data, kv_heads)
        if data.ndim <= 1 or new_name.endswith("_norm.weight") or not new_name.endswith(".weight"):
            tensor_type = gguf.GGMLQuantizationType.F32
        else:
            tensor_type = qtype
        stored = gguf.quants.quantize(data.astype(np.float32), tensor_type)
        writer.add_tensor(new_name, stored, raw_dtype=tensor_type if stored.dtype == np.uint8 else None)
        n_tensors += 1
        if progress:
            progress(n_tensors, 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"architecture": spec.gguf_arch, "outtype": outtype, "tensors": n_tensors, **vocab_facts}
