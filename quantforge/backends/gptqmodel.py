"""GPTQ int4/int8 and AWQ int4 through GPTQModel, as the classic checkpoints vLLM and transformers load.

- gptq-int4 / gptq-int8: ``quant_method: gptq`` (qweight/qzeros/scales/g_idx), symmetric, group 128, act-order
  (``desc_act``) as a setting: the layout of Qwen's -GPTQ-Int4/-Int8 releases.
- awq: ``quant_method: awq``, GEMM packing, 4-bit, group 128, with zero points (asymmetric), as AutoAWQ wrote it.

Measured facts this relies on (GPTQModel 7.6, torch 2.13 CPU): GPTQModel needs GPTQMODEL_CPU_WORKERS set on a
2-core machine or it refuses to start; AWQ on CPU needs the torch backend and a bf16/fp16 model (fp32 fails when
packing); ``offload_to_disk`` writes its folder's path into config.json, so the path is dropped after saving
to keep artifacts reproducible, and the folder is the run's, not a random temporary one (``disk_offload``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from . import Format, QuantizeJob
from .hf import (
    VLLM_RUNTIMES,
    HFFolderBackend,
    drop_load_time_keys,
    load_calibration,
    move_logs,
    set_threads,
    unquantized_back_to_bf16,
    vllm_target,
)

FORMATS = {
    "gptq-int4": Format(
        "gptq-int4", "hf", "GPTQ W4A16", VLLM_RUNTIMES, 4.25, "GPTQ 4-bit (vLLM, transformers)", "GPTQ-Int4"
    ),
    "gptq-int8": Format(
        "gptq-int8", "hf", "GPTQ W8A16", VLLM_RUNTIMES, 8.25, "GPTQ 8-bit (vLLM, transformers)", "GPTQ-Int8"
    ),
    "awq": Format("awq", "hf", "AWQ W4A16 GEMM", VLLM_RUNTIMES, 4.25, "AWQ 4-bit GEMM (vLLM, transformers)", "AWQ"),
}
BITS = {"gptq-int4": 4, "gptq-int8": 8, "awq": 4}


# GPTQModel 7.6 imports tokenicer, which on import sets HF_HOME, HF_HUB_CACHE, TRANSFORMERS_CACHE and
# HF_MODULES_CACHE to /tmp/tokenicer_hf_home when they are unset: every later download of the process, and every
# child process (the converter, the speed probe), would then use that cache instead of the user's.
HF_CACHE_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE")


@contextlib.contextmanager
def hf_cache_settings_kept():
    """Put the Hugging Face cache variables back as they were once the block (an import) is done."""
    saved = {name: os.environ.get(name) for name in HF_CACHE_VARIABLES}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _drop_local_paths(folder: Path) -> None:
    """GPTQModel records its offload folder in the configs it saves: a local path has no place in a release, and
    it would make two runs' artifacts differ."""
    import json

    for name in ("config.json", "quantize_config.json"):
        path = folder / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        section = data.get("quantization_config", data)
        meta = section.get("meta") or {}
        if "offload_to_disk_path" in meta:
            meta.pop("offload_to_disk_path")
            path.write_text(json.dumps(data, indent=2) + "\n")


def disk_offload(job: QuantizeJob, resumable: bool, dtype: str) -> dict:
    """GPTQModel's disk offload, its own default, which we used to turn off: the model is a shell whose layers
    are read from the checkpoint as the quantizer reaches them and written to disk once done, so the whole model is
    never resident (SmolLM2-135M, GPTQ int4: the quantizer's peak 1.04 GB against 1.25, same time, the artifact
    byte for byte the same; docs/design.md). Its folder is in the run's work folder, not a random temporary one:
    removed with the format's checkpoints once the artifact is complete, and dropped from the saved config.

    Not for a float32 calibration: unquantized parameters left on disk cannot be cast back to bf16 before saving
    (``unquantized_back_to_bf16``). Not without a checkpoint folder (a backend called outside a build)."""
    if job.checkpoint_dir is None or (dtype == "float32" and not resumable):
        return {"offload_to_disk": False}
    folder = job.checkpoint_dir / "offload"
    if not resumable:  # a killed run's offloaded modules are no part of this one
        shutil.rmtree(folder, ignore_errors=True)
    return {"offload_to_disk": True, "offload_to_disk_path": str(folder)}


def let_go_of_the_model() -> None:
    """Drop the two references GPTQModel 7.6 keeps to a finished quantization, so its model is freed.

    - Every forward it stops early raises one module-level exception instance (``STOP_FORWARD_EXCEPTION``). The
      instance keeps the traceback of its last raise, and through those frames the whole call stack down to our
      ``quantize``, with the model in its locals.
    - Each idle worker thread of its device pool keeps the arguments of the last task it ran until the next one
      comes. Shutting the pool down ends those threads. GPTQModel builds a new pool the next time one is asked
      for (``gptqmodel.get_device_thread_pool``).

    Measured on SmolLM2-135M: 0.35 GB stayed resident after each quantize and was carried into every later stage
    of the build. That is about the size of the quantized model, so at 7B a build of three GPTQModel formats
    would carry some 17 GB into its last evaluation.
    """
    import gptqmodel
    from gptqmodel.nn_modules import hooked_linear

    stop = getattr(hooked_linear, "STOP_FORWARD_EXCEPTION", None)
    if stop is not None:
        stop.__traceback__ = None
        stop.__context__ = None
    pool = getattr(gptqmodel, "_DEVICE_THREAD_POOL", None)
    if pool is not None:
        pool.shutdown()
        gptqmodel._DEVICE_THREAD_POOL = None


def per_layer_type_rope(config: dict) -> bool:
    """RoPE parameters given per attention-layer type (Gemma 3: {"sliding_attention": {...}, "full_attention": ...})."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or {}
    return isinstance(rope, dict) and any(isinstance(value, dict) for value in rope.values())


class GPTQModelBackend(HFFolderBackend):
    name = "gptqmodel"
    formats = FORMATS
    requires = ("gptqmodel", "optimum")
    extra = "gptq"
    progress_pattern = r"Quantizing layer (\d+) of (\d+)"  # 0-based index of the layer, index of the last one
    # GPTQ in float32 where that is faster (device.quantizer_dtype); GPTQModel packs AWQ only from 16 bits.
    follows_quantize_dtype = frozenset({"gptq-int4", "gptq-int8"})

    def cost_model(self, fmt) -> str:
        return "awq" if fmt.name == "awq" else "gptq"

    def unsupported(self, source, fmt) -> str | None:
        # Their bug, not our call (found on Gemma 3): GPTQModel 7.6's config normalization
        # (gptqmodel.utils.hf._normalize_rope_parameters_config_compat) writes flat rope_type/rope_theta keys into
        # rope_parameters that are given per layer type, and transformers 5 rejects that config when GPTQModel
        # saves the quantized model ("'str' object has no attribute 'get'" in validate_rope), after all the work.
        config = json.loads((source.path / "config.json").read_text())
        if per_layer_type_rope(config):
            alternative = "; use --backend llmcompressor for it" if fmt.name.startswith("gptq-") else ""
            return (
                f"{self.library()} cannot save {source.config.get('architecture')} models: it rewrites their "
                f"per-layer-type RoPE parameters into a config transformers rejects{alternative}"
            )
        return None

    def quantize(self, job: QuantizeJob) -> dict:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, job.threads)))
        import torch

        with hf_cache_settings_kept():
            from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

        set_threads(job.threads)
        group_size, note = self.group_size(job.source, job.format, job.settings)
        bits = BITS[job.format.name]
        act_order = bool(job.settings.get("act_order", False))
        # GPTQModel resumes layer by layer from a checkpoint only for llama models, and only with its disk
        # offload on. Off unless asked (--layer-resume): measured on a tiny llama killed half way, the resumed
        # checkpoint differed from an uninterrupted run's in 18 packed tensors, while a restart from scratch is
        # byte-identical.
        resumable = (
            job.settings.get("layer_resume")
            and job.checkpoint_dir is not None
            and job.source.config.get("model_type") == "llama"
        )
        dtype = job.dtype  # the plan's choice for GPTQ (pipeline.calibration_dtype); bf16 for AWQ
        offload = disk_offload(job, resumable, dtype)
        if job.format.name == "awq":
            config = QuantizeConfig(
                bits=bits, group_size=group_size, quant_method="awq", format="gemm", sym=False, **offload
            )
        else:
            config = QuantizeConfig(bits=bits, group_size=group_size, desc_act=act_order, sym=True, **offload)
        from gptqmodel.looper import loop_processor

        # GPTQModel writes per-layer logs to ./logs of whatever directory it runs in: keep them in the run.
        loop_processor._PROJECT_LOG_DIR = job.log_dir / "gptqmodel"
        calibration = load_calibration(job.calibration)
        samples = [
            {
                "input_ids": torch.as_tensor(row, dtype=torch.long)[None],
                "attention_mask": torch.ones(1, len(row), dtype=torch.long),
            }
            for row in calibration
        ]
        torch.manual_seed(0)
        try:
            model = GPTQModel.load(
                str(job.source.path),
                config,
                dtype=getattr(torch, dtype),
                device=job.device,
                trust_remote_code=job.source.trust_remote_code,
            )
            checkpoint = None
            if resumable:
                # GPTQModel's own resume: finished layers are kept in the checkpoint folder, and a run killed half
                # way continues at the layer where it stopped.
                from gptqmodel.looper.checkpoint_store import CheckpointConfig

                checkpoint = CheckpointConfig(path=str(job.checkpoint_dir), resume="auto", interval="layer:1")
            # The torch kernels on CPU (the only ones there); on a GPU GPTQModel picks its own.
            kernels = BACKEND.TORCH if job.device == "cpu" else BACKEND.AUTO
            model.quantize(samples, batch_size=1, backend=kernels, checkpoint=checkpoint)
            unquantized_back_to_bf16(model.model)
            model.save(str(job.out))
        finally:
            # On a failure the exception's traceback keeps this frame alive while the pipeline records it: drop
            # the model here too, so a failed format does not carry it into the next one.
            model = None
            let_go_of_the_model()
        _drop_local_paths(job.out)
        drop_load_time_keys(job.out)
        move_logs(job.out, job.log_dir, job.format.name, ("quant_log.csv",))
        facts = {
            "library": "gptqmodel",
            "bits": bits,
            "group_size": group_size,
            "calibration_samples": int(calibration.shape[0]),
            "calibration_seqlen": int(calibration.shape[1]),
            "calibration_dtype": dtype,
        }
        if job.format.name != "awq":
            facts["act_order"] = act_order
        if note:
            facts["group_size_note"] = note
        from ..dequant import split_fused_projections

        split = split_fused_projections(job.out, job.source.trust_remote_code)
        if split:  # GPTQModel 7.6 saves Phi-3's gate_up_proj so: vLLM loads the folder, transformers does not
            facts["not_runtimes"] = {
                "transformers": f"{', '.join(split)} saved as its parts, which vLLM fuses back when it loads and "
                "transformers does not"
            }
        return facts

    def probe_target(self, artifact_dir: Path) -> tuple[str, Path] | str:
        # vLLM where installed (its Marlin kernels); else transformers with GPTQModel's CPU (torch) kernels, what a
        # CPU user would run, unless transformers cannot load the folder (see split_fused_projections).
        from ..dequant import split_fused_projections

        served = vllm_target(artifact_dir)
        if served:
            return served
        split = split_fused_projections(artifact_dir) if (artifact_dir / "config.json").exists() else []
        if split:
            parts = ", ".join(split)
            return f"not measured here: vLLM not installed, and transformers does not load {parts} saved as its parts"
        return ("transformers", artifact_dir)
