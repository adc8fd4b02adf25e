"""float32 arithmetic over weights that stay small in memory until the module that uses them runs.

A float32 copy of a model costs twice its bf16 checkpoint, and evaluating it that way put a 7B build at about 47 GB of
RAM. Widening bf16 (or fp16) to float32 is exact, so a module that holds its stored weights and widens them only for
the length of its own forward computes the very same numbers as a float32 model, while memory holds the stored
weights plus one module's float32 copy. Quantized checkpoints go one step further: a weight is kept packed and
dequantized (to the same float32 values ``dequant`` gives) when its module runs.

Parameters under ``SMALL_PARAMETER`` elements (norms, biases) are widened once and for
all: hooks would cost more time than they save memory. Buffers (rotary frequencies, Gemma's embedding scale) are
computed in float32 as a float32 model computes them, never taken from a bf16 initialisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

SMALL_PARAMETER = 1 << 16  # norms and biases: widened once, for good

WeightSource = Callable[[], torch.Tensor]  # gives a float32 tensor, on the module's device, when called


def _widen_on_entry(module: torch.nn.Module, args) -> None:
    for name, make in module._quantforge_sources.items():
        module._parameters[name] = torch.nn.Parameter(make(), requires_grad=False)


def _narrow_on_exit(module: torch.nn.Module, args, output) -> None:
    module._parameters.update(module._quantforge_resting)


def attach_sources(module: torch.nn.Module, sources: dict[str, WeightSource]) -> None:
    """Give ``module`` weights that exist in float32 only while its forward runs."""
    if not hasattr(module, "_quantforge_sources"):
        module._quantforge_sources = {}
        module._quantforge_resting = {}
        module.register_forward_pre_hook(_widen_on_entry)
        module.register_forward_hook(_narrow_on_exit)
    for name, make in sources.items():
        module._quantforge_sources[name] = make
        module._quantforge_resting[name] = module._parameters.get(name)


def widened(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The float32 value of a stored weight or bias: the one place a module's parameters are widened."""
    return None if tensor is None else tensor.float()


def _widened(stored: torch.Tensor) -> WeightSource:
    return lambda: widened(stored)


# Weight elements widened at a time by a large Linear (4 MB of float32). 16 MB slices left the 135M reference 50 MB
# higher (heap churn; measured over three windows in one process) and ran no faster (the slice's GEMM is as fast).
CHUNK_ELEMENTS = 1 << 20


def _gather_rows_on_entry(module: torch.nn.Module, args, kwargs):
    """An embedding looks up a few rows: widen only those (a 150k-token table is 2 GB in float32)."""
    ids = args[0] if args else next(iter(kwargs.values()))
    rows, positions = torch.unique(ids, return_inverse=True)
    module._parameters["weight"] = torch.nn.Parameter(module._quantforge_stored[rows].float(), requires_grad=False)
    module._quantforge_padding, module.padding_idx = module.padding_idx, None  # an index into the full table
    if args:
        return (positions, *args[1:]), kwargs
    return args, {next(iter(kwargs)): positions}


def _restore_table_on_exit(module: torch.nn.Module, args, kwargs, output) -> None:
    module._parameters["weight"] = module._quantforge_resting_table
    module.padding_idx = module._quantforge_padding


def _chunked_linear(module: torch.nn.Linear, stored: torch.Tensor):
    """forward() of a large Linear (an LM head, a wide projection) that widens a slice of output rows at a time,
    writing each slice's product straight into the output (no list of parts to concatenate: that would double the
    logits' memory)."""
    rows = max(1, CHUNK_ELEMENTS // stored.shape[1])

    def forward(x: torch.Tensor) -> torch.Tensor:
        # The bias is read when the module runs, through the one widening every parameter gets: it may be replaced
        # (widened, or placed from a checkpoint) after this forward was made. A Qwen2 q/k/v projection at hidden
        # 1536 and up once kept its bf16 bias here and failed ("self and mat2 must have the same dtype").
        bias = widened(module.bias)
        out = x.new_empty((*x.shape[:-1], stored.shape[0]))
        for start in range(0, stored.shape[0], rows):
            part = None if bias is None else bias[start : start + rows]
            out[..., start : start + rows] = torch.nn.functional.linear(x, widened(stored[start : start + rows]), part)
        return out

    return forward


def keep_stored(module: torch.nn.Module, name: str, stored: torch.Tensor) -> None:
    """Hold ``stored`` (a bf16/fp16 weight) as ``module.name`` and widen it to float32 only while the module runs:
    the rows it looks up (embeddings), a slice at a time (Linears), or whole (anything else)."""
    if isinstance(module, torch.nn.Embedding) and name == "weight":
        module._quantforge_stored = stored
        module._quantforge_resting_table = module._parameters["weight"]
        module.register_forward_pre_hook(_gather_rows_on_entry, with_kwargs=True)
        module.register_forward_hook(_restore_table_on_exit, with_kwargs=True)
    elif isinstance(module, torch.nn.Linear) and name == "weight" and stored.numel() > CHUNK_ELEMENTS:
        module.forward = _chunked_linear(module, stored)
    else:
        attach_sources(module, {name: _widened(stored)})


def compute_in_float32(model: torch.nn.Module) -> torch.nn.Module:
    """Make every module compute in float32 while large weights stay in their stored (narrower) dtype."""
    for module in model.modules():
        # Small parameters (biases, norms) first, so that no large weight's forward is made while a sibling is
        # still narrow, whatever order named_parameters yields them in.
        parameters = sorted(module.named_parameters(recurse=False), key=lambda item: item[1].numel() >= SMALL_PARAMETER)
        for name, param in parameters:
            if param.dtype == torch.float32 or not param.is_floating_point():
                continue
            if param.numel() < SMALL_PARAMETER:
                module._parameters[name] = torch.nn.Parameter(widened(param.detach()), requires_grad=False)
            else:
                keep_stored(module, name, param.detach())
    return model


def buffers_to(model: torch.nn.Module, device: str) -> None:
    """Move every buffer to ``device`` (a model whose parameters rest on meta cannot be moved with ``.to``)."""
    for module in model.modules():
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[leaf] = buffer.to(device)


def float32_buffers(model: torch.nn.Module, config) -> None:
    """Replace computed buffers with the values a float32 model computes (a bf16 initialisation rounds them)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh = dict(skeleton.named_buffers())
    for name, buffer in list(model.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if name in fresh and fresh[name].device.type != "meta":
            owner._buffers[leaf] = fresh[name].to(buffer.device)
        elif buffer.is_floating_point():
            owner._buffers[leaf] = buffer.float()


def stored_dtype_model(folder: Path, *, device: str = "cpu", trust_remote_code: bool = False) -> torch.nn.Module:
    """The checkpoint in its stored dtype, computing in float32: the same logits as loading it in float32."""
    from .memory import import_transformers_slim

    import_transformers_slim()  # before transformers' model classes, which would import scikit-learn and more
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype="auto", trust_remote_code=trust_remote_code, use_safetensors=True, device_map=device
    )
    float32_buffers(model, model.config)
    model.config.dtype = torch.float32  # code that reads the config's dtype must see what the arithmetic uses
    return compute_in_float32(model).eval()
