"""Memory fit on a GPU, and the files that put an artifact to use: serve commands, an Ollama Modelfile.

Memory model (stated on the card): a serving engine may use ``GPU_UTILIZATION`` of the GPU's memory (vLLM's
default ``--gpu-memory-utilization``), of which ``RUNTIME_OVERHEAD_GB`` goes to activations, the CUDA context and
graphs; the rest holds the weights (the artifact's tensor bytes) and the KV cache, which costs
layers x KV heads x head dim x 2 (K and V) x 2 bytes (fp16) per token of every sequence, or fewer bytes per value
for a quantized cache (vLLM's fp8: 1; llama.cpp's q8_0: 34 per 32 values).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from .errors import QuantforgeError, one_line
from .gpus import GPUS

GPU_UTILIZATION = 0.90
RUNTIME_OVERHEAD_GB = 1.0
KV_DTYPE_BYTES = 2
FP8_KV_BYTES = 1


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bandwidth_gbs: float | None  # None for a custom "20GB" entry


def parse_gpu(text: str) -> GPU:
    """A GPU from the built-in table (case and spaces ignored) or a custom size such as ``20GB``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|G|GIB)?\s*", text, re.IGNORECASE)
    if match:
        memory = float(match.group(1))
        if memory <= 0:
            raise QuantforgeError(f"--gpu {text}: the memory size must be positive")
        return GPU(f"{memory:g} GB GPU", memory, None)
    wanted = re.sub(r"[\s_-]", "", text).lower()
    for name, (memory, bandwidth) in GPUS.items():
        if re.sub(r"[\s_-]", "", name).lower() == wanted:
            return GPU(name, memory, bandwidth)
    raise QuantforgeError(f"unknown GPU '{text}'; known: {', '.join(GPUS)}, or a size such as 20GB")


def kv_bytes_per_token(config: dict, dtype_bytes: float = KV_DTYPE_BYTES) -> int:
    return round(config["num_layers"] * config["num_kv_heads"] * config["head_dim"] * 2 * dtype_bytes)


def _largest_context(left_for_kv: float, per_token: int, concurrency: int, max_positions: int | None) -> int:
    largest = int(left_for_kv // (per_token * concurrency)) if left_for_kv > 0 else 0
    return min(largest, max_positions) if max_positions else largest


def memory_fit(
    weight_bytes: int,
    config: dict,
    gpu: GPU,
    context: int,
    concurrency: int,
    quantized_kv: tuple[str, float] = ("fp8", FP8_KV_BYTES),
) -> dict:
    """Whether the weights and the KV cache of ``concurrency`` sequences of ``context`` tokens fit, at an fp16 KV
    cache and, as the fallback a user can choose, the runtime's quantized one (``quantized_kv``: its name and bytes
    per value; vLLM's ``--kv-cache-dtype fp8`` by default, llama.cpp's ``q8_0`` for a GGUF)."""
    usable = gpu.memory_gb * 1e9 * GPU_UTILIZATION - RUNTIME_OVERHEAD_GB * 1e9
    per_token = kv_bytes_per_token(config)
    per_token_quantized = kv_bytes_per_token(config, quantized_kv[1])
    needed = weight_bytes + per_token * context * concurrency
    needed_quantized = weight_bytes + per_token_quantized * context * concurrency
    left_for_kv = usable - weight_bytes
    max_positions = config.get("max_position_embeddings")
    return {
        "gpu": gpu.name,
        "gpu_memory_gb": gpu.memory_gb,
        "context": context,
        "concurrency": concurrency,
        "weights_gb": weight_bytes / 1e9,
        "kv_cache_gb": per_token * context * concurrency / 1e9,
        "needed_gb": needed / 1e9,
        "usable_gb": usable / 1e9,
        "fits": needed <= usable,
        "largest_context": _largest_context(left_for_kv, per_token, concurrency, max_positions),
        "kv_bytes_per_token": per_token,
        "quantized_kv": quantized_kv[0],
        "fits_with_quantized_kv": needed_quantized <= usable,
        "largest_context_quantized_kv": _largest_context(left_for_kv, per_token_quantized, concurrency, max_positions),
    }


# ----------------------------------------------------------------------------------------------- commands
#
# vLLM reads the method from config.json's quantization_config and upgrades GPTQ/AWQ checkpoints to its fastest
# kernels itself (each method's override_quantization_method); naming --quantization pins the slow ones, so the
# commands never pass it. The flags below are checked against vLLM's and llama.cpp's own argument tables by
# tests/test_deploy.py.


def vllm_command(folder_name: str, max_model_len: int, kv_cache: str | None = None) -> str:
    command = f"vllm serve ./{folder_name} --max-model-len {max_model_len} --gpu-memory-utilization {GPU_UTILIZATION}"
    return command + (f" --kv-cache-dtype {kv_cache}" if kv_cache else "")


def llama_server_command(gguf_name: str, context: int, kv_cache: str | None = None) -> str:
    """An OpenAI-compatible server with the GGUF's own chat template (--jinja); llama.cpp offloads to a GPU itself.
    A quantized KV cache needs flash attention on (llama.cpp refuses a quantized V cache without it)."""
    command = f"llama-server -m {shlex.quote(gguf_name)} -c {context} --jinja"
    return command + _llama_kv_flags(kv_cache)


def _llama_kv_flags(kv_cache: str | None) -> str:
    return f" -fa on -ctk {kv_cache} -ctv {kv_cache}" if kv_cache else ""


def llama_cli_command(gguf_name: str, context: int, kv_cache: str | None = None) -> str:
    """An interactive chat in the terminal (llama-cli chats by default when the model has a chat template)."""
    command = f"llama-cli -m {shlex.quote(gguf_name)} -c {context} --jinja"
    return command + _llama_kv_flags(kv_cache)


def ollama_command(model_name: str) -> str:
    return f"ollama create {model_name} -f Modelfile"


def serving(fit: dict | None, context: int) -> tuple[int, str | None]:
    """The context to serve and the quantized KV cache to ask for (None: the 16-bit one): the asked context when
    it fits at fp16, else with the fit's quantized cache when that fits, else the largest context that fits at fp16
    (no fit known: the asked context)."""
    if not fit or fit["fits"]:
        return context, None
    if fit["fits_with_quantized_kv"]:
        return context, fit["quantized_kv"]
    return max(fit["largest_context"], 1), None


# ----------------------------------------------------------------------------------------------- Ollama

MARK = "\x00{}\x00"


def _render(template: str, messages: list[dict], add_generation_prompt: bool, special: dict) -> str:
    """The chat template rendered as transformers renders it: in jinja2's immutable sandbox, with trim_blocks,
    lstrip_blocks, loop controls, ``raise_exception`` and ``strftime_now``. A template from an untrusted repository
    can therefore neither run code nor touch Python objects; any failure is one line."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        variables = {name: value for name, value in special.items() if name != "runtime_adds_bos"}
        rendered, _ = render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=add_generation_prompt, **variables
        )
    except Exception as exc:  # jinja2's SecurityError, TemplateError, and whatever the template's own code raises
        raise QuantforgeError(f"the chat template failed to render ({one_line(exc)})") from None
    text = rendered[0]
    # llama.cpp (and so Ollama) adds BOS itself when the GGUF says so; a template that writes it would double it
    bos = special.get("bos_token")
    if special.get("runtime_adds_bos") and bos and text.startswith(bos):
        text = text[len(bos) :]
    return text


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start) + len(start) : text.index(end)]


def chat_template_to_ollama(template: str, special: dict) -> tuple[str, list[str]]:
    """An Ollama (Go text/template) TEMPLATE equivalent to a Hugging Face chat template, and its stop strings.

    The Jinja template is rendered with marked messages to learn, for each role, the text around a message, any
    default system block it inserts, and the generation prompt. Templates whose per-role wrapping is not that
    regular (tool calls, content-dependent branches) are refused rather than approximated. ``special`` holds
    ``bos_token``, ``eos_token`` and ``runtime_adds_bos`` (a leading BOS is then left to the runtime).
    """
    s, u, a = MARK.format("S"), MARK.format("U"), MARK.format("A")
    u2 = MARK.format("U2")
    full = _render(
        template,
        [
            {"role": "system", "content": s},
            {"role": "user", "content": u},
            {"role": "assistant", "content": a},
            {"role": "user", "content": u2},
        ],
        True,
        special,
    )
    try:
        system_prefix = full[: full.index(s)]
        system_suffix, user_prefix = _split_gap(_between(full, s, u), full, s, u, template, special)
        user_suffix, assistant_prefix = _split_gap(_between(full, u, a), full, u, a, template, special)
        assistant_suffix = _between(full, a, u2)[: -len(user_prefix)] if user_prefix else _between(full, a, u2)
        generation = full[full.index(u2) + len(u2) + len(user_suffix) :]
    except ValueError:
        raise QuantforgeError(
            "this chat template does not wrap messages in a fixed way per role; write the Ollama TEMPLATE by hand"
        ) from None
    no_system = _render(template, [{"role": "user", "content": u}], True, special)
    default_system = (
        no_system[: no_system.index(u)][: -len(user_prefix)] if user_prefix else no_system[: no_system.index(u)]
    )

    def literal(text: str) -> str:
        if "{{" in text or "}}" in text:
            raise QuantforgeError("the chat template's fixed text contains '{{': write the Ollama TEMPLATE by hand")
        return text

    parts = []
    if default_system:
        parts.append(
            '{{ if or (not .Messages) (ne (index .Messages 0).Role "system") }}'
            f"{literal(default_system)}{{{{ end }}}}"
        )
    parts.append("{{ range .Messages }}")
    parts.append(f'{{{{ if eq .Role "system" }}}}{literal(system_prefix)}{{{{ .Content }}}}{literal(system_suffix)}')
    parts.append(f'{{{{ else if eq .Role "user" }}}}{literal(user_prefix)}{{{{ .Content }}}}{literal(user_suffix)}')
    parts.append(
        f'{{{{ else if eq .Role "assistant" }}}}{literal(assistant_prefix)}{{{{ .Content }}}}'
        f"{literal(assistant_suffix)}"
    )
    parts.append("{{ end }}{{ end }}" + literal(generation))
    stops = sorted(
        {piece.strip() for piece in (user_suffix, assistant_suffix, special.get("eos_token") or "") if piece.strip()}
    )
    return "".join(parts), stops


def _split_gap(gap: str, full: str, left: str, right: str, template: str, special: dict) -> tuple[str, str]:
    """Split the text between two messages into the first one's suffix and the second one's prefix.

    The suffix of a role is what follows its content when the conversation ends there (no generation prompt).
    """
    role_of = {MARK.format("S"): "system", MARK.format("U"): "user"}
    messages = [{"role": role_of[left], "content": left}]
    ended = _render(template, messages, False, special)
    suffix = ended[ended.index(left) + len(left) :]
    if not gap.startswith(suffix):
        raise ValueError
    return suffix, gap[len(suffix) :]


def modelfile(gguf_name: str, template: str | None, stops: list[str], context: int) -> str:
    """An Ollama Modelfile; without a TEMPLATE, Ollama falls back to the chat template stored in the GGUF."""
    lines = [f"FROM ./{gguf_name}"]
    lines += [f'TEMPLATE """{template}"""'] if template is not None else []
    lines += [f"PARAMETER num_ctx {context}"]
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"
