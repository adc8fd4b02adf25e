"""INT8 W8A8 (SmoothQuant + GPTQ), FP8 W8A8, NVFP4 and MXFP4 through llm-compressor, as the compressed-tensors
checkpoints vLLM serves.

``int8``: weights int8 per output channel (GPTQ), activations int8 per token, quantized dynamically at run time;
SmoothQuant first moves activation outliers into the weights. The same library also writes GPTQ W4A16/W8A16 as
compressed-tensors (``--backend llmcompressor`` for gptq-int4/gptq-int8), the layout vLLM prefers.

``nvfp4``: FP4 (E2M1) weights in groups of 16 with an FP8 scale each under a per-tensor global scale, and the
same for activations at run time (their global scale calibrated on the run's calibration set); Blackwell's 4-bit
format. ``nvfp4-a16`` is its weights alone (no calibration), ``mxfp4-a16`` the OCP MX variant's weights alone
(groups of 32, power-of-two scales). Both are rounded to nearest (llm-compressor's QuantizationModifier), not GPTQ.

Measured facts (llm-compressor 0.14.0.1, CPU): ``oneshot`` runs on CPU; its AWQModifier does not (it needs an
accelerator), so AWQ comes from GPTQModel; SmoothQuant lives in ``modifiers.transform.smoothquant`` in 0.14.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from . import Format, QuantizeJob
from .hf import VLLM_RUNTIMES, HFFolderBackend, drop_load_time_keys, load_calibration, set_threads, vllm_target

# Where vLLM's kernels run each (its quantization hardware table): INT8 W8A8 from Turing to Hopper (no INT8 GEMM on
# Blackwell); FP8 W8A8 on Ada, Hopper and Blackwell, and on Turing/Ampere as weight-only FP8 (Marlin).
INT8_GENERATIONS = ("turing", "ampere", "ada", "hopper")
FP8_GENERATIONS = ("ada", "hopper", "blackwell")
# FP4 in vLLM: W4A4 NVFP4 on Blackwell's FP4 tensor cores; from Ampere on, its FP4 Marlin kernel runs FP4 weights
# alone (NVFP4 W4A4 checkpoints too, their activations then left in 16 bits).
FP4_WEIGHT_GENERATIONS = ("ampere", "ada", "hopper", "blackwell")
FORMATS = {
    "int8": Format(
        "int8",
        "hf",
        "W8A8 INT8",
        VLLM_RUNTIMES,
        8.1,
        "INT8 weights and activations (vLLM)",
        "W8A8",
        gpu_generations=INT8_GENERATIONS,
    ),
    "gptq-int4": Format(
        "gptq-int4", "hf", "GPTQ W4A16 (compressed-tensors)", VLLM_RUNTIMES, 4.25, hub_suffix="GPTQ-Int4"
    ),
    "gptq-int8": Format(
        "gptq-int8", "hf", "GPTQ W8A16 (compressed-tensors)", VLLM_RUNTIMES, 8.25, hub_suffix="GPTQ-Int8"
    ),
    # FP8 E4M3 weights per output channel and activations per token, scaled at run time: the 8-bit format of
    # Hopper, Ada and Blackwell GPUs. Round to nearest, no calibration data (llm-compressor's FP8_DYNAMIC scheme).
    "fp8": Format(
        "fp8",
        "hf",
        "FP8 W8A8 dynamic",
        VLLM_RUNTIMES,
        8.1,
        "FP8 weights and activations (vLLM on Hopper, Ada, Blackwell)",
        "FP8-Dynamic",
        gpu_generations=FP8_GENERATIONS,
        gpu_weight_only=("turing", "ampere"),
    ),
    # 4 bits and an FP8 scale per 16 weights (4.5 bits), activations likewise at run time
    "nvfp4": Format(
        "nvfp4",
        "hf",
        "NVFP4 W4A4",
        VLLM_RUNTIMES,
        4.5,
        "FP4 weights and activations (vLLM on Blackwell; weights alone on Ampere to Hopper)",
        "NVFP4",
        gpu_generations=("blackwell",),
        gpu_weight_only=("ampere", "ada", "hopper"),
    ),
    "nvfp4-a16": Format(
        "nvfp4-a16",
        "hf",
        "NVFP4 W4A16",
        VLLM_RUNTIMES,
        4.5,
        "FP4 weights, 16-bit activations (vLLM, Ampere to Blackwell)",
        "NVFP4A16",
        gpu_generations=FP4_WEIGHT_GENERATIONS,
    ),
    # 4 bits and a power-of-two scale per 32 weights (4.25 bits)
    "mxfp4-a16": Format(
        "mxfp4-a16",
        "hf",
        "MXFP4 W4A16",
        VLLM_RUNTIMES,
        4.25,
        "MX FP4 weights, 16-bit activations (vLLM, Ampere to Blackwell)",
        "MXFP4A16",
        gpu_generations=FP4_WEIGHT_GENERATIONS,
    ),
}
SCHEMES = {
    "int8": "W8A8",
    "gptq-int4": "W4A16",
    "gptq-int8": "W8A16",
    "fp8": "FP8_DYNAMIC",
    "nvfp4": "NVFP4",
    "nvfp4-a16": "NVFP4A16",
    "mxfp4-a16": "MXFP4A16",
}
# The resource plan's measured costs each format is priced by (resources.QUANTIZER_LIBRARY)
COST_MODELS = {"int8": "int8", "fp8": "fp8", "nvfp4": "nvfp4", "nvfp4-a16": "fp4", "mxfp4-a16": "fp4"}
DATA_FREE = frozenset({"fp8", "nvfp4-a16", "mxfp4-a16"})
ROUND_TO_NEAREST = DATA_FREE | {"nvfp4"}  # QuantizationModifier's scheme alone, no GPTQ
# The group each FP4 scheme fixes (it is part of the format: vLLM's kernels take no other)
FP4_GROUP = {"nvfp4": 16, "nvfp4-a16": 16, "mxfp4-a16": 32}
# A mixture of experts' routers stay in 16 bits (llm-compressor's and vLLM's FP8 MoE examples leave them out: they
# are small, and a quantized router changes which experts run).
ROUTERS = ["re:.*mlp.gate$", "re:.*shared_expert_gate$"]
SMOOTHING_STRENGTH = 0.8  # llm-compressor's W8A8 examples

# Model types where SmoothQuant as llm-compressor 0.14 maps it would change what the model computes, so int8 is made
# without it (GPTQ int8 weights, dynamic per-token int8 activations). llm-compressor maps these families onto its
# default pairs (input_layernorm -> q/k/v, post_attention_layernorm -> gate/up), which assumes pre-norm blocks
# whose norm multiplies by its weight. Measured on tiny random models (perplexity change of int8 on the same windows):
# Gemma 3 +754% with it. Why: Gemma's RMSNorm multiplies by (1 + weight), so dividing the weight by the smoothing
# scales is not dividing the output by them; and in Gemma 2/3 and OLMo 2 "post_attention_layernorm" normalizes the
# attention *output* before the residual add (the MLP is fed by pre_feedforward_layernorm, or by no norm in OLMo 2).
_GEMMA = "Gemma's RMSNorm scales by 1 + weight, and post_attention_layernorm normalizes the attention output"
_POST_NORM = "it normalizes after attention and MLP, so no norm feeds the projections SmoothQuant would scale"
NO_SMOOTHQUANT = {
    "gemma": "Gemma's RMSNorm scales by 1 + weight, which SmoothQuant cannot fold its scales into",
    **dict.fromkeys(("gemma2", "gemma3", "gemma3_text"), _GEMMA),
    **dict.fromkeys(("olmo2", "olmo3"), _POST_NORM),
}


@contextlib.contextmanager
def model_let_go_afterwards():
    """Drop the two references llm-compressor 0.14 keeps to the model it compressed, so it is freed.

    - Its global compression session holds the model in its state until the session is reset.
    - Its sequential pipeline compiles each traced forward into a namespace that holds the model, and registers
      functions of that namespace with ``torch.fx.wrap``. torch.fx keeps every namespace so registered in a
      module-level table (``_wrapped_fns_to_patch``) for the life of the process. The entries this run added are
      removed.

    Measured on SmolLM2-135M (int8): 0.36 GB stayed resident after the stage, about the size of the model.
    """
    import torch.fx._symbolic_trace as symbolic_trace

    wrapped = getattr(symbolic_trace, "_wrapped_fns_to_patch", {})
    registered_before = set(wrapped)
    try:
        yield
    finally:
        from llmcompressor.core import reset_session

        reset_session()
        for key in set(wrapped) - registered_before:
            del wrapped[key]


class LLMCompressorBackend(HFFolderBackend):
    name = "llmcompressor"
    formats = FORMATS
    requires = ("llmcompressor", "compressed_tensors")
    extra = "int8"
    alternative_for = frozenset({"gptq-int4", "gptq-int8"})
    progress_pattern = r"\((\d+)/(\d+)\): Propagating"  # one pass over the layers per modifier

    def cost_model(self, fmt) -> str:
        return COST_MODELS.get(fmt.name, "gptq")

    def calibrates(self, fmt) -> bool:
        return fmt.name not in DATA_FREE

    def group_size(self, source, fmt, settings: dict):
        if fmt.name in ("int8", "fp8"):
            return None, None  # per output channel: no groups
        if fmt.name in FP4_GROUP:
            return FP4_GROUP[fmt.name], None
        return super().group_size(source, fmt, settings)

    def quantize(self, job: QuantizeJob) -> dict:
        import torch
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from datasets import Dataset
        from llmcompressor.modifiers.quantization import GPTQModifier

        set_threads(job.threads)
        if job.format.name in DATA_FREE:
            return self.quantize_round_to_nearest(job)
        calibration = load_calibration(job.calibration)
        dataset = Dataset.from_dict(
            {
                "input_ids": [row.tolist() for row in calibration],
                "attention_mask": [[1] * calibration.shape[1]] * calibration.shape[0],
            }
        )
        if job.format.name in ROUND_TO_NEAREST:  # NVFP4: the calibration fixes its activations' global scales
            return self.quantize_round_to_nearest(job, dataset, calibration.shape)
        group_size, note = self.group_size(job.source, job.format, job.settings)
        scheme = SCHEMES[job.format.name]
        recipe = []
        no_smoothing = NO_SMOOTHQUANT.get(job.source.config.get("model_type"))
        if job.format.name == "int8":
            if not no_smoothing:
                from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

                recipe.append(SmoothQuantModifier(smoothing_strength=SMOOTHING_STRENGTH))
            gptq = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        else:
            bits = 4 if scheme == "W4A16" else 8
            weights = QuantizationArgs(
                num_bits=bits,
                type="int",
                symmetric=True,
                strategy="group",
                group_size=group_size,
                actorder="static" if job.settings.get("act_order") else None,
            )
            gptq = GPTQModifier(
                config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}, ignore=["lm_head"]
            )
        recipe.append(gptq)
        torch.manual_seed(0)
        self.compress(
            job,
            recipe,
            dataset=dataset,
            max_seq_length=int(calibration.shape[1]),
            num_calibration_samples=int(calibration.shape[0]),
        )
        facts = {
            "library": "llmcompressor",
            "scheme": scheme,
            "calibration_samples": int(calibration.shape[0]),
            "calibration_seqlen": int(calibration.shape[1]),
        }
        if job.format.name == "int8" and no_smoothing:
            facts["smoothquant"] = f"not applied: {no_smoothing}"
        elif job.format.name == "int8":
            facts["smoothquant_strength"] = SMOOTHING_STRENGTH
        else:
            facts["group_size"] = group_size
        if note:
            facts["group_size_note"] = note
        return facts

    def quantize_round_to_nearest(self, job: QuantizeJob, dataset=None, shape=None) -> dict:
        """FP8 dynamic, NVFP4A16, MXFP4A16 (no calibration data) and NVFP4 W4A4 (the calibration set fixes each
        activation's global scale): llm-compressor's QuantizationModifier, weights rounded to nearest."""
        from llmcompressor.modifiers.quantization import QuantizationModifier

        scheme = SCHEMES[job.format.name]
        modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head", *ROUTERS])
        facts = {"library": "llmcompressor", "scheme": scheme}
        if job.format.name in FP4_GROUP:
            facts |= {"group_size": FP4_GROUP[job.format.name], "rounding": "to nearest (no GPTQ)"}
        if dataset is None:
            self.compress(job, [modifier])
            return facts | {"calibration": "none (data-free)"}
        calibration = {"max_seq_length": int(shape[1]), "num_calibration_samples": int(shape[0])}
        self.compress(job, [modifier], dataset=dataset, **calibration)
        return facts | {"calibration_samples": int(shape[0]), "calibration_seqlen": int(shape[1])}

    def compress(self, job: QuantizeJob, recipe: list, **calibration) -> None:
        """Load the source in bf16, run llm-compressor's oneshot with ``recipe``, save the compressed folder."""
        import torch
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # bf16, as GPTQModel loads it too: the tensors left unquantized (embeddings, norms) are saved in the dtype
        # the model was calibrated in, and a release ships them in 16 bits.
        model = AutoModelForCausalLM.from_pretrained(
            job.source.path,
            dtype=torch.bfloat16,
            device_map=job.device,
            trust_remote_code=job.source.trust_remote_code,
        )
        tokenizer = AutoTokenizer.from_pretrained(job.source.path)
        with model_let_go_afterwards():
            oneshot(model=model, recipe=recipe, **calibration)
            model.save_pretrained(job.out, save_compressed=True)
        tokenizer.save_pretrained(job.out)
        drop_load_time_keys(job.out)

    def probe_target(self, artifact_dir: Path) -> tuple[str, Path] | str:
        return vllm_target(artifact_dir) or (
            "not measured here: vLLM not installed (compressed-tensors checkpoints run in vLLM's kernels, on a GPU; "
            "transformers only decompresses them to float, which says nothing about their speed)"
        )
