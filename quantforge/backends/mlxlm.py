"""MLX formats through mlx-lm's own converter: the folders Apple-silicon users load with ``mlx_lm`` (and LM Studio).

``mlx-4bit`` and ``mlx-8bit`` are mlx-lm's affine quantization: each group of 64 weights along the input width
stores its integers with a 16-bit scale and offset (4.5 and 8.5 bits a weight). Unlike the other formats here it
quantizes the embedding table too (and an untied output layer); a Linear whose width 64 does not divide stays in
16 bits, as mlx-lm decides.

Evaluation loads the folder from disk in mlx itself, which runs on Linux CPUs as ``mlx[cpu]``: the logits are the
runtime's, computed as mlx-lm computes them on a Mac (16-bit activations), not a dequantization of ours. The speed
probe runs mlx-lm's own generation loop as stored (16-bit); a CPU's figure says nothing of a Mac's GPU, and the speed
table's device column says where it ran.

Measured (mlx 0.32.4, mlx-lm 0.32.2, this project's 2-core hosts): converting the tiny llama takes 1 s, the tiny
qwen2 (152k vocabulary) 3 s; importing mlx_lm takes 6 s (it imports transformers), so it is imported in the
children that quantize, evaluate and probe, never in the build process.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import numpy as np

from . import Backend, Deployment, Format, LogitsRunner, QuantizeJob, library_version

GROUP_SIZE = 64  # mlx-lm's default for affine quantization, and what mlx-community's folders use
BITS = {"mlx-4bit": 4, "mlx-8bit": 8}
# A generation name of no NVIDIA GPU: the card's GPU table then says MLX does not run on any of them (gpus.py).
APPLE = "apple silicon"
# A window's logits (mlx's float32 array, whole) are handed over this many positions at a time
LOGIT_BLOCK = 128


def _mlx_format(name: str) -> Format:
    bits = BITS[name]
    return Format(
        name,
        "mlx",
        f"MLX {bits}-bit affine g{GROUP_SIZE}",
        ("mlx",),
        bits + 32 / GROUP_SIZE,  # a 16-bit scale and a 16-bit offset per group
        f"{bits}-bit weights, 16-bit activations (mlx-lm on Apple silicon)",
        f"MLX-{bits}bit",
        gpu_generations=(APPLE,),
    )


FORMATS = {name: _mlx_format(name) for name in BITS}


def _device_name() -> str:
    """ "cpu" or "gpu": where mlx computes (Linux wheels have the CPU alone; a Mac, its GPU)."""
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def mlx_lm_model_types() -> set[str] | None:
    """The model types mlx-lm loads: a module of its own under ``mlx_lm/models``, or a name its loader maps onto one
    (``MODEL_REMAPPING`` in ``mlx_lm/utils.py``, read from the source: importing mlx_lm takes 6 s). None when that
    cannot be read (another layout): then nothing is refused up front."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    modules = {path.stem for path in (package / "models").glob("*.py")}
    try:
        tree = ast.parse((package / "utils.py").read_text())
        remapping = next(
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MODEL_REMAPPING" for t in node.targets)
        )
    except (OSError, SyntaxError, ValueError, StopIteration):
        return None
    return modules | {name for name, target in remapping.items() if target in modules}


def mlx_generate_command(folder_name: str) -> str:
    return f"mlx_lm.generate --model ./{shlex.quote(folder_name)} --prompt Hello --max-tokens 64"


def mlx_server_command(folder_name: str) -> str:
    """mlx-lm's OpenAI-compatible server (it applies the folder's chat template to /v1/chat/completions)."""
    return f"mlx_lm.server --model ./{shlex.quote(folder_name)} --port 8080"


def rope_keys_for_mlx(config_path: Path) -> list[str]:
    """Write the RoPE settings of a transformers-5 config where mlx-lm's models read them; returns the keys added.

    transformers 5 saves ``rope_theta`` (and the scaling) nested in ``rope_parameters``, per layer type for models
    with sliding and global layers (Gemma 3). mlx-lm 0.32's models other than Qwen3 read only the top-level keys
    and otherwise take their own defaults, silently: SmolLM2 (theta 100000) ran at mlx's llama default of 10000, and
    its mlx-8bit measured KLD 0.12 and +7.6% perplexity against the reference (0.0028 and -0.3% once the key was
    written; Q8_0 0.0047)."""
    import json

    from ..fsutil import atomic_write_text

    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention")
    wanted = {}
    if "rope_theta" in full:
        wanted["rope_theta"] = full["rope_theta"]
    if full.get("rope_type", "default") != "default":
        wanted["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    if local and "rope_theta" in local:
        wanted["rope_local_base_freq"] = local["rope_theta"]
    added = [key for key in wanted if key not in config]
    if added:
        atomic_write_text(config_path, json.dumps(config | {k: wanted[k] for k in added}, indent=4) + "\n")
    return added


class MLXRunner:
    """A folder loaded by mlx-lm: next-token logits as mlx computes them (its CPU device on Linux)."""

    def __init__(self, folder: Path):
        import mlx.core as mx
        from mlx_lm import load

        self.model, _ = load(str(folder))
        # Float32 activations, as the reference and the torch-evaluated formats have: the figures measure the
        # folder's weights (its integers and 16-bit scales, widened exactly), not 16-bit arithmetic. It is also what
        # makes mlx on a Linux CPU usable at all: its 16-bit quantized products there ran 8x slower (the tiny
        # llama's 128-token window: 13.8 s against 1.7 s).
        self.model.set_dtype(mx.float32)
        self.runtime = f"mlx {mx.__version__} ({_device_name()}, float32 activations)"

    def _forward(self, tokens: np.ndarray):
        """One window through the model as mlx-lm runs a prompt: into a fresh KV cache of the model's own kinds
        (a rotating one for Gemma 3's sliding-window layers)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        ids = mx.array(np.asarray(tokens, dtype=np.int32)[None, :])
        out = self.model(ids, cache=make_prompt_cache(self.model))[0]
        mx.eval(out)
        return out

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        return np.array(self._forward(tokens))  # float32: the model computes in float32 (set_dtype above)

    def scored_logits(self, tokens: np.ndarray, first: int = 0):
        """Positions ``first`` to the last but one, a block at a time."""
        out, scored = self._forward(tokens), len(tokens) - 1
        for start in range(first, scored, LOGIT_BLOCK):
            yield np.array(out[start : min(start + LOGIT_BLOCK, scored)])

    def last_logits(self, tokens: np.ndarray, rows: int) -> np.ndarray:
        return np.array(self._forward(tokens)[-rows:])

    def close(self) -> None:
        import mlx.core as mx

        self.model = None
        mx.clear_cache()


class MLXBackend(Backend):
    name = "mlx"
    formats = FORMATS
    requires = ("mlx_lm", "mlx")  # quantization failures name the first: mlx-lm's converter
    extra = "mlx"
    runtime_module = "mlx"
    quantizes_in_transformers = False  # mlx-lm reads the safetensors itself (it imports transformers for tokenizers)

    def cost_model(self, fmt: Format) -> str:
        return "mlx"

    def unsupported(self, source, fmt: Format) -> str | None:
        """A model type mlx-lm has no model code for is refused up front, not after the reference has run."""
        model_type = source.config.get("model_type")
        known = mlx_lm_model_types()
        if known is None or model_type in known:
            return None
        return (
            f"{library_version('mlx_lm')} has no model code for {source.config.get('architecture')} "
            f"(model_type '{model_type}'), so it can neither convert nor run it"
        )

    def quantize(self, job: QuantizeJob) -> dict:
        from mlx_lm import convert

        from ..logs import capture_output

        # mlx-lm keeps the checkpoint's dtype only when the config names it under its old key (torch_dtype);
        # transformers 5 writes "dtype", so it is passed: the unquantized tensors and scales stay 16-bit, as in
        # mlx-community's folders, whatever precision the source was saved in.
        dtype = job.source.config.get("torch_dtype") or job.source.config.get("dtype") or "bfloat16"
        dtype = dtype if dtype in ("bfloat16", "float16") else "bfloat16"
        bits = BITS[job.format.name]
        with capture_output(job.log_dir / f"{job.format.name}-convert.log"):
            convert(
                str(job.source.path),
                mlx_path=str(job.out),
                quantize=True,
                q_bits=bits,
                q_group_size=GROUP_SIZE,
                dtype=dtype,
                trust_remote_code=job.source.trust_remote_code,
            )
        (job.out / "README.md").unlink(missing_ok=True)  # mlx-lm's own card; the release writes quantforge's
        facts = {"library": "mlx-lm", "bits": bits, "group_size": GROUP_SIZE, "mode": "affine", "dtype": dtype}
        added = rope_keys_for_mlx(job.out / "config.json")
        return facts | ({"config_keys_added": added} if added else {})

    def open_runner(self, artifact_dir: Path, *, context: int, threads: int, device: str = "cpu") -> LogitsRunner:
        return MLXRunner(artifact_dir)

    def probe_target(self, artifact_dir: Path) -> tuple[str, Path] | str:
        return ("mlx", artifact_dir)

    def probe(self, runtime, path: Path, prompt: list[int], gen_tokens: int, threads: int, runs: int, device="cpu"):
        """mlx-lm's generation loop (greedy), a time read as each token comes out; mlx picks its own threads."""
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        from ..probe import _median_report, _timings

        model, _ = load(str(path))

        def once() -> dict:
            started, token_times = time.perf_counter(), []
            for _ in generate_step(mx.array(prompt), model, max_tokens=gen_tokens):
                token_times.append(time.perf_counter() - started)
            # the first token comes with the prompt's forward: its time stands for the prompt's
            return _timings(token_times[0], token_times[0], token_times, len(prompt))

        once()  # warm-up
        result = _median_report([once() for _ in range(runs)])
        return result | {"device": _device_name()}

    def deployment(self, folder: Path, card: dict, entry: dict, chat: tuple[str | None, dict]) -> Deployment:
        """mlx-lm's generate and OpenAI-compatible server commands (on a Mac; ``pip install mlx-lm``)."""
        import json

        quantization = json.loads((folder / "config.json").read_text()).get("quantization", {})
        usage = [
            "```bash",
            "pip install mlx-lm",
            mlx_generate_command(folder.name),
            mlx_server_command(folder.name),
            "```",
        ]
        return Deployment("mlx", ["mlx"], quantization, usage)
