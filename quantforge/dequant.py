"""Dequantize quantized HF checkpoints from disk into a float torch model, in plain torch.

Used to evaluate GPTQ, AWQ and compressed-tensors artifacts on a CPU that has no kernel for them, on the same
footing as the float reference. One small function per checkpoint format, keyed by ``quant_method``:

- ``gptq`` (classic, "v1"): qweight packs 32/bits input rows per int32; qzeros packs output columns and stores
  each zero point minus one; scales and g_idx give each input row's group.
- ``awq`` (GEMM): qweight and qzeros pack 8 output columns per int32 in the interleaved order 0,2,4,6,1,3,5,7;
  zero points are stored as they are.
- ``compressed-tensors``: ``int-quantized`` stores int8 weights with per-channel scales; ``float-quantized`` FP8
  (E4M3) weights with per-channel scales; ``pack-quantized`` packs signed 4/8-bit values with an offset of
  2^(bits-1), 32/bits per int32 along the input dimension; ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized``
  pack two FP4 (E2M1) codes per byte, the first in the low nibble (bit 3 the sign, bits 0-2 an index into the eight
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6). NVFP4 scales each 16 values by an FP8 E4M3 scale divided by one float32
  global scale per tensor; MXFP4 each 32 values by a power of two stored as a biased exponent (E8M0, bias 127).

Formats whose activations are quantized at run time (W8A8: dynamic per-token int8 or FP8; NVFP4 W4A4: FP4 in
groups of 16 with an FP8 scale each, under the global scale calibrated into the file) get that applied to each
quantized Linear's input, as vLLM's kernels do.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import torch

from .errors import QuantforgeError
from .lean import SMALL_PARAMETER, WeightSource, attach_sources, keep_stored

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 -> [R * 32/bits, C]: values packed along the first dimension, lowest bits first."""
    values = (packed.unsqueeze(1) >> _shifts(bits, packed.device)[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 -> [R, C * 32/bits]: values packed along the second dimension, lowest bits first."""
    values = (packed.unsqueeze(2) >> _shifts(bits, packed.device)[None, None, :]) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)


def dequantize_gptq(tensors: dict[str, torch.Tensor], prefix: str, config: dict) -> torch.Tensor:
    bits = config["bits"]
    qweight, scales = tensors[f"{prefix}.qweight"], tensors[f"{prefix}.scales"].float()
    out_features = scales.shape[1]
    weight = unpack_rows(qweight, bits)
    zeros = unpack_cols(tensors[f"{prefix}.qzeros"], bits)[:, :out_features]
    if config.get("checkpoint_format", "gptq") == "gptq":
        zeros = zeros + 1  # classic GPTQ stores zero - 1
    in_features = weight.shape[0]
    g_idx = tensors.get(f"{prefix}.g_idx")
    rows = torch.arange(in_features, device=qweight.device)
    groups = g_idx.long() if g_idx is not None else rows // config["group_size"]
    return ((weight - zeros[groups]).float() * scales[groups]).T.contiguous()


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    raw = unpack_cols(packed, 4).reshape(packed.shape[0], -1, 8)
    ordered = torch.empty_like(raw)
    ordered[:, :, AWQ_ORDER] = raw  # bit slot j holds column AWQ_ORDER[j]
    return ordered.reshape(packed.shape[0], -1)


def dequantize_awq(tensors: dict[str, torch.Tensor], prefix: str, config: dict) -> torch.Tensor:
    if config.get("bits", 4) != 4:
        raise QuantforgeError("only 4-bit AWQ (GEMM) checkpoints can be dequantized")
    weight = _awq_unpack(tensors[f"{prefix}.qweight"])
    zeros = _awq_unpack(tensors[f"{prefix}.qzeros"])
    scales = tensors[f"{prefix}.scales"].float()
    groups = torch.arange(weight.shape[0], device=weight.device) // config["group_size"]
    return ((weight - zeros[groups]).float() * scales[groups]).T.contiguous()


FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1: the eight values a code's low 3 bits select
FP4_MAX = 6.0


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 2] bytes -> [rows, cols] float32 values: two E2M1 codes a byte, the first in the low nibble."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    table = torch.tensor(FP4_MAGNITUDES + tuple(-m for m in FP4_MAGNITUDES), device=packed.device)
    return table[codes]


def _per_group(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values * scale.repeat_interleave(values.shape[1] // scale.shape[1], dim=1)


def dequantize_fp4(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    values = unpack_fp4(tensors[f"{prefix}.weight_packed"])
    scale = tensors[f"{prefix}.weight_scale"]
    if scale.dtype == torch.uint8:  # MXFP4: E8M0 exponents
        return _per_group(values, torch.exp2(scale.float() - 127.0))
    # NVFP4: the FP8 block scale over the tensor's global scale, as the checkpoint's own decompression divides it
    return _per_group(values, scale.float() / tensors[f"{prefix}.weight_global_scale"].float())


def dequantize_compressed(tensors: dict[str, torch.Tensor], prefix: str, config: dict) -> torch.Tensor:
    weights = _weights_scheme(config)
    if weights.get("type") == "float" and weights.get("num_bits") == 4:
        return dequantize_fp4(tensors, prefix)
    scale = tensors[f"{prefix}.weight_scale"].float()
    if f"{prefix}.weight_packed" in tensors:
        bits = weights["num_bits"]
        packed = tensors[f"{prefix}.weight_packed"]
        rows, cols = (int(x) for x in tensors[f"{prefix}.weight_shape"].tolist())
        values = unpack_cols(packed, bits)[:, :cols].float() - (1 << (bits - 1))
    else:
        values = tensors[f"{prefix}.weight"].float()
        rows, cols = values.shape
    if scale.shape[1] == 1:  # per output channel
        return values * scale
    group = cols // scale.shape[1]
    return values * scale.repeat_interleave(group, dim=1)


def _weights_scheme(config: dict) -> dict:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantforgeError("compressed-tensors checkpoints with several quantization groups are not supported")
    return next(iter(groups.values()))["weights"]


def _activation_scheme(config: dict) -> dict | None:
    groups = config.get("config_groups") or {}
    return next(iter(groups.values())).get("input_activations") if groups else None


DEQUANTIZERS: dict[str, tuple[str, Callable]] = {
    # quant_method -> (the tensor suffix that marks a quantized Linear, dequantizer)
    "gptq": ("qweight", dequantize_gptq),
    "awq": ("qweight", dequantize_awq),
    "compressed-tensors": ("weight_scale", dequantize_compressed),
}


def read_tensors(folder: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file, device=device))
    return tensors


# A tensor as stored (bf16/fp16 embeddings, norms, biases), or what makes its float32 value when called (a
# quantized weight, dequantized from its packed tensors; a fused weight, from its parts).
Weight = torch.Tensor | WeightSource


def _float(weight: Weight) -> torch.Tensor:
    if callable(weight):
        return weight()
    return weight.float() if weight.is_floating_point() else weight


def weight_sources(
    folder: Path, device: str = "cpu", dequantizers: dict[str, tuple[str, Callable]] | None = None
) -> tuple[dict, dict[str, Weight]]:
    """The artifact's config (without quantization_config) and every tensor by name: quantized weights as what
    dequantizes them when called, the others as stored. ``dequantizers`` adds methods (a backend's own) to ours."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.pop("quantization_config", None)
    if quant is None:
        raise QuantforgeError(f"{folder}/config.json has no quantization_config")
    method = quant.get("quant_method")
    known = {**DEQUANTIZERS, **(dequantizers or {})}
    if method not in known:
        raise QuantforgeError(f"cannot dequantize quant_method '{method}' (known: {', '.join(known)})")
    marker, dequantize = known[method]
    tensors = read_tensors(folder, device)
    prefixes = sorted({name[: -len(marker) - 1] for name in tensors if name.endswith("." + marker)})
    sources: dict[str, Weight] = {}
    for prefix in prefixes:
        sources[f"{prefix}.weight"] = functools.partial(dequantize, tensors, prefix, quant)
    quantized = set(prefixes)
    module_tensors: dict[str, dict[str, torch.Tensor]] = {}  # a quantized Linear's other tensors (input scales)
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        if owner in quantized and leaf != "bias":
            if leaf.startswith("input_"):
                module_tensors.setdefault(owner, {})[leaf] = tensor
            continue
        sources[name] = tensor
    extra = {"_quantization_config": quant, "_quantized_modules": prefixes, "_module_tensors": module_tensors}
    return {**config, **extra}, sources


def dequantized_state_dict(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The artifact's config (without quantization_config) and a float32 state dict of every tensor."""
    config, sources = weight_sources(folder)
    return config, {name: _float(weight) for name, weight in sources.items()}


def quantize_activations_per_token(module: torch.nn.Module, args):
    """Dynamic symmetric int8 per token, as W8A8 kernels quantize a Linear's input at run time."""
    (x,) = args
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
    return (torch.round(x / scale).clamp(-128, 127) * scale,)


FP8_MAX = 448.0  # the largest finite float8 E4M3 value


def fp8_activations_per_token(module: torch.nn.Module, args):
    """Dynamic FP8 (E4M3) per token, as FP8 W8A8 kernels quantize a Linear's input at run time: each token scaled
    so that its largest magnitude is FP8's largest value, then rounded to FP8."""
    (x,) = args
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale,)


def round_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """Each value to the nearest E2M1 value (x already within +-6); a tie goes to the larger magnitude."""
    grid = torch.tensor(FP4_MAGNITUDES, device=x.device, dtype=x.dtype)
    midpoints = (grid[1:] + grid[:-1]) / 2
    return torch.sign(x) * grid[torch.bucketize(x.abs(), midpoints, right=True)]


# What a zero FP8 block scale is replaced by, as the library does: float8 E4M3's epsilon (0.125)
FP8_SMALLEST_SCALE = torch.finfo(torch.float8_e4m3fn).eps


def nvfp4_activations(global_scale: torch.Tensor, group: int = 16):
    """NVFP4 activations, as Blackwell's W4A4 kernels quantize a Linear's input at run time: per group of 16 values
    a scale (largest magnitude / 6) is multiplied by the calibrated global scale and rounded to FP8 E4M3; each value
    is divided by that scale over the global scale, rounded to FP4, and multiplied back."""

    def hook(module: torch.nn.Module, args):
        (x,) = args
        groups = x.unflatten(-1, (x.shape[-1] // group, group))
        largest = groups.abs().amax(dim=-1, keepdim=True)
        scale = (largest / FP4_MAX * global_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        scale = torch.where(scale == 0, torch.full_like(scale, FP8_SMALLEST_SCALE), scale) / global_scale
        quantized = round_to_fp4((groups / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
        return (quantized.flatten(-2),)

    return hook


def activation_hook(scheme: dict | None, module_tensors: dict[str, torch.Tensor] | None = None):
    """The run-time activation quantization a compressed-tensors scheme asks for, simulated, or None.
    ``module_tensors``: the quantized Linear's own tensors (NVFP4 keeps each input's global scale there)."""
    if not scheme or not scheme.get("dynamic"):
        return None
    if scheme.get("num_bits") == 4 and scheme.get("type") == "float" and scheme.get("strategy") == "tensor_group":
        if "input_global_scale" not in (module_tensors or {}):
            raise QuantforgeError("an NVFP4 W4A4 checkpoint lacks a Linear's input_global_scale: remake the file")
        return nvfp4_activations(module_tensors["input_global_scale"].float(), scheme["group_size"])
    if scheme.get("num_bits") != 8:
        return None
    return fp8_activations_per_token if scheme.get("type") == "float" else quantize_activations_per_token


# Fused projections some architectures have (Phi-3), and the parts a quantizer may have saved them as instead:
# GPTQModel 7.6 quantizes Phi-3's gate_up_proj as gate_proj and up_proj (vLLM re-fuses them when it loads).
FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "qkv_proj": ("q_proj", "k_proj", "v_proj")}


# transformers 5 holds a mixture of experts' weights as one 3-D parameter per projection ([experts, out, in];
# gate_up_proj is gate then up), while checkpoints (and llm-compressor's, GPTQModel's outputs) keep one Linear per
# expert: experts.{i}.gate_proj/up_proj/down_proj, or Mixtral's w1 (gate), w3 (up), w2 (down).
EXPERT_PARTS = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}


def _stack_experts(per_expert: list[list[Weight]]) -> torch.Tensor:
    return torch.stack([_concatenate(parts) for parts in per_expert])


def _concatenate(parts: list[Weight]) -> torch.Tensor:
    return torch.cat([_float(part) for part in parts], dim=0)


def _fuse_experts(sources: dict[str, Weight], name: str) -> bool:
    experts, _, fused = name.rpartition(".")
    for parts in EXPERT_PARTS.get(fused, ()):
        count = 0
        while all(f"{experts}.{count}.{part}.weight" in sources for part in parts):
            count += 1
        if count:
            per_expert = [[sources.pop(f"{experts}.{i}.{part}.weight") for part in parts] for i in range(count)]
            sources[name] = functools.partial(_stack_experts, per_expert)
            return True
    return False


def split_fused_projections(folder: Path, trust_remote_code: bool = False) -> list[str]:
    """The fused projections (``gate_up_proj``, ``qkv_proj``) of the folder's architecture that its quantizer saved
    as their parts instead. vLLM fuses such parts back when it loads; transformers 5.17 does not (it leaves the fused
    weight uninitialized), so a folder that has any does not run in transformers."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .artifacts import _tensors

    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), trust_remote_code=trust_remote_code)
    modules = {name for name, _ in model.named_modules()}
    saved = {name.rpartition(".")[0] for name, _ in _tensors(folder)}
    split = set()
    for module in modules:
        owner, _, fused = module.rpartition(".")
        parts = FUSED_PARTS.get(fused, ())
        if parts and module not in saved and all(f"{owner}.{part}" in saved for part in parts):
            split.add(fused)
    return sorted(split)


def fuse_split_projections(sources: dict[str, Weight], expected: set[str]) -> None:
    """Concatenate saved parts (in the model's own output order) into the fused weight the architecture expects."""
    for name in sorted(expected - set(sources)):
        if _fuse_experts(sources, name):
            continue
        owner, _, leaf = name.rpartition(".")
        module, _, fused = owner.rpartition(".")
        parts = [f"{module}.{part}.{leaf}" for part in FUSED_PARTS.get(fused, ())]
        if parts and all(part in sources for part in parts):
            sources[name] = functools.partial(_concatenate, [sources.pop(part) for part in parts])


def _tie_sources(model: torch.nn.Module, sources: dict[str, Weight]) -> None:
    """A tied output embedding reads the input embedding's weight (checkpoints store it once)."""
    names = {module: name for name, module in model.named_modules()}
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None:
        return
    source = sources.get(f"{names[inputs]}.weight")
    if source is not None:
        sources.setdefault(f"{names[outputs]}.weight", source)


def _place(model: torch.nn.Module, name: str, weight: Weight) -> None:
    """Large weights stay packed (or stored) until their module runs; small ones are made float32 now."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if leaf in owner._buffers:
        owner._buffers[leaf] = _float(weight)
    elif owner._parameters[leaf].numel() < SMALL_PARAMETER or getattr(weight, "dtype", None) == torch.float32:
        owner._parameters[leaf] = torch.nn.Parameter(_float(weight), requires_grad=False)
    elif callable(weight):
        attach_sources(owner, {leaf: weight})
    else:
        keep_stored(owner, leaf, weight)  # an unquantized bf16/fp16 tensor: embeddings, the LM head


def float_model_from_artifact(
    folder: Path,
    *,
    device: str = "cpu",
    trust_remote_code: bool = False,
    dequantizers: dict[str, tuple[str, Callable]] | None = None,
    simulate_activations: bool = True,
) -> torch.nn.Module:
    """A model computing in float32 with the dequantized weights of a quantized HF folder (activations simulated
    too, unless ``simulate_activations`` is False: the weights alone, as a library that only decompresses runs it).
    Its large weights stay packed and are dequantized when their module runs (see ``lean``), so memory holds the
    artifact's size plus one module's float32 weights, and the logits equal a fully dequantized model's."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .lean import buffers_to

    config_dict, sources = weight_sources(folder, device, dequantizers)
    quant = config_dict.pop("_quantization_config")
    quantized = config_dict.pop("_quantized_modules")
    module_tensors = config_dict.pop("_module_tensors")
    config = AutoConfig.for_model(**{k: v for k, v in config_dict.items() if not k.startswith("_")})
    with init_empty_weights(include_buffers=False):  # parameters on meta: each is placed below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    buffers_to(model, device)  # built in float32 already: its computed buffers are a float32 model's
    expected = set(model.state_dict())
    fuse_split_projections(sources, expected)
    if config.tie_word_embeddings:
        _tie_sources(model, sources)
    missing, unexpected = sorted(expected - set(sources)), sorted(set(sources) - expected)
    if missing or unexpected:
        raise QuantforgeError(
            f"{folder} does not match its architecture: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, weight in sources.items():
        _place(model, name, weight)
    activations = _activation_scheme(quant) if quant.get("quant_method") == "compressed-tensors" else None
    model.quantforge_unsimulated = 0  # quantized Linears whose runtime activation quantization is not simulated
    if simulate_activations and activations:
        modules = dict(model.named_modules())
        for prefix in quantized:
            hook = activation_hook(activations, module_tensors.get(prefix))
            if hook and prefix in modules:
                modules[prefix].register_forward_pre_hook(hook)
            elif hook:  # an expert's projection, now a slice of a fused 3-D parameter: no module to hook
                model.quantforge_unsimulated += 1
    return model.eval()
