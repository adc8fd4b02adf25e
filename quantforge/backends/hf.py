"""What the backends that write Hugging Face folders (GPTQ, AWQ, compressed-tensors) share.

- Group sizes are checked against every Linear's input width before any work: a group must divide the width.
  With ``--group-size auto`` the largest standard size that divides every width is used and recorded.
- Evaluation loads the artifact from disk and dequantizes it in plain torch (``quantforge.dequant``), since a CPU
  has no kernels for most of these formats; runtime-quantized activations (W8A8) are simulated.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np

from ..errors import QuantforgeError
from . import Backend, Deployment, LogitsRunner

VLLM_RUNTIMES = ("vllm", "transformers")
GROUP_CANDIDATES = (128, 64, 32, 16)


def linear_input_widths(config: dict) -> dict[str, int]:
    """Input width of each kind of decoder Linear, from the config alone."""
    hidden = config["hidden_size"]
    attention = (config.get("num_heads") or 1) * (config.get("head_dim") or 0) or hidden
    return {
        "self_attn.{q,k,v}_proj": hidden,
        "self_attn.o_proj": attention,
        "mlp.{gate,up}_proj": hidden,
        "mlp.down_proj": config["intermediate_size"],
    }


def resolve_group_size(config: dict, requested) -> tuple[int, str | None]:
    """(group size to use, a note when it differs from what was asked), or a one-line error."""
    widths = linear_input_widths(config)
    dividing = [g for g in GROUP_CANDIDATES if all(w % g == 0 for w in widths.values())]
    if requested in (None, "auto"):
        if not dividing:
            raise QuantforgeError(
                f"no group size in {GROUP_CANDIDATES} divides the layer widths {sorted(set(widths.values()))}"
            )
        chosen = dividing[0]
        note = (
            None
            if chosen == GROUP_CANDIDATES[0]
            else (
                f"group size {GROUP_CANDIDATES[0]} does not divide every layer width "
                f"({', '.join(f'{k}: {w}' for k, w in widths.items() if w % GROUP_CANDIDATES[0])}); used {chosen}"
            )
        )
        return chosen, note
    group = int(requested)
    bad = {name: width for name, width in widths.items() if width % group}
    if bad:
        layers = ", ".join(f"{name} ({width})" for name, width in bad.items())
        options = ", ".join(str(g) for g in dividing) or "none of " + ", ".join(map(str, GROUP_CANDIDATES))
        raise QuantforgeError(
            f"group size {group} does not divide the input width of {layers}; group sizes that divide every "
            f"layer: {options}; pass one with --group-size, or --group-size auto"
        )
    return group, None


def set_threads(threads: int) -> None:
    """The same torch thread count wherever a backend runs (a Ray worker starts with one): float sums are ordered
    by threads, so this keeps a format's bytes the same under every executor."""
    import torch

    torch.set_num_threads(max(1, threads))


def unquantized_back_to_bf16(model) -> None:
    """After a float32 calibration: the parameters it left unquantized (embeddings, norms, LM head, biases) back to
    bf16, as a bf16 calibration saves them, so that the artifact's layout and size do not depend on the arithmetic.
    The quantized weights are integer buffers with 16-bit scales either way."""
    import torch

    for param in model.parameters():
        if param.dtype == torch.float32:
            param.data = param.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16


def load_calibration(path: Path | None) -> np.ndarray:
    if path is None:
        raise QuantforgeError("this format needs a calibration set, and none was prepared")
    return np.load(path)


def move_logs(out: Path, log_dir: Path, label: str, names: tuple[str, ...]) -> None:
    """Library side files that are logs, not model (their timings would make the artifact differ run to run)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (out / name).exists():
            shutil.move(str(out / name), log_dir / f"{label}-{name}")


# Arguments of the load that transformers writes back into tokenizer_config.json on save. They describe how the
# quantizing process loaded its source (offline or not, a local folder, which commit), not the model: published,
# they would make the same artifact differ between a laptop and a Ray worker (measured: local_files_only).
LOAD_TIME_KEYS = ("local_files_only", "is_local", "_commit_hash")


def drop_load_time_keys(folder: Path) -> None:
    import json

    path = folder / "tokenizer_config.json"
    if not path.exists():
        return
    data = json.loads(path.read_text())
    if any(key in data for key in LOAD_TIME_KEYS):
        path.write_text(json.dumps({k: v for k, v in data.items() if k not in LOAD_TIME_KEYS}, indent=2) + "\n")


def vllm_target(artifact_dir: Path) -> tuple[str, Path] | None:
    """The speed probe runs an HF artifact in vLLM, its serving runtime, wherever vLLM is installed."""
    import importlib.util

    return ("vllm", artifact_dir) if importlib.util.find_spec("vllm") is not None else None


class HFFolderBackend(Backend):
    """A backend whose artifacts are HF folders with a quantization_config, evaluated dequantized."""

    needs_calibration = True
    # quant_method -> (the tensor suffix that marks a quantized Linear, function(tensors, prefix, quantization_config)
    # -> its float weight): how evaluation dequantizes a method quantforge.dequant does not know (a plugin's own)
    dequantizers: ClassVar[dict[str, tuple[str, Callable]]] = {}

    def check(self, source, fmt, settings: dict) -> list[str]:
        try:
            self.group_size(source, fmt, settings)
        except QuantforgeError as exc:
            return [str(exc)]
        return []

    def group_size(self, source, fmt, settings: dict) -> tuple[int | None, str | None]:
        return resolve_group_size(source.config, settings.get("group_size", 128))

    def open_runner(self, artifact_dir: Path, *, context: int, threads: int, device: str = "cpu") -> LogitsRunner:
        from ..dequant import float_model_from_artifact
        from ..runners import TorchRunner

        model = float_model_from_artifact(artifact_dir, device=device, dequantizers=self.dequantizers)
        runner = TorchRunner(model, threads)
        runner.runtime = "transformers (dequantized in torch)"
        if model.quantforge_unsimulated:
            runner.runtime += (
                f"; activation quantization not simulated in {model.quantforge_unsimulated} expert projections"
            )
        return runner

    def deployment(self, folder: Path, card: dict, entry: dict, chat: tuple[str | None, dict]) -> Deployment:
        """vLLM's serve command (its context fitted to the card's GPU, when one was named) and a transformers load."""
        import json

        from ..deploy import serving, vllm_command

        quant_config = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
        context = card["targets"]["context"]
        fit = next(iter(entry.get("memory_fit", {}).values()), None) if card["targets"].get("gpu") else None
        max_len, kv_cache = serving(fit, context)
        usage = ["```bash", vllm_command(folder.name, max_len, kv_cache), "```"]
        if kv_cache:
            held = f"{context} tokens x {fit['concurrency']} sequence(s)"
            usage += ["", f"An fp16 KV cache of {held} does not fit on {fit['gpu']}; an {kv_cache} one does."]
        refused = (entry.get("quantize") or {}).get("not_runtimes", {}).get("transformers")
        if refused:
            usage += ["", f"transformers does not load this folder: {refused}."]
        else:
            usage += [
                "",
                "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                f'model = AutoModelForCausalLM.from_pretrained("./{folder.name}", device_map="auto")',
                f'tokenizer = AutoTokenizer.from_pretrained("./{folder.name}")',
                "```",
            ]
        return Deployment("transformers", [str(quant_config.get("quant_method"))], quant_config, usage)
