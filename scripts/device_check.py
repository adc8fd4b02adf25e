#!/usr/bin/env python3
"""The GPU half of quantforge's device choice, checked in one short run on a machine whose Python already holds
torch and transformers but which can install nothing (no package index): this workplace's lent GPU machine.
``scripts/gpu_check.sh`` is the whole-build check for a user's GPU machine, where ``scripts/install.sh`` can run.

  prepare DIR        here, on CPU, with the real quantizers: a tiny SentencePiece-vocabulary mistral (DIR/model)
                     and a build of its GPTQ int4, AWQ int4 and INT8 artifacts (DIR/run; 16 MB in all, small
                     enough to travel with the tree)
  run [DIR] --out O  there: for tiny random models of eight architectures, and DIR's artifacts when given, the
                     logits and every evaluation figure computed on the CPU and on CUDA through quantforge's own
                     code (the lean reference, the dequantized evaluation, ``resolve_device``), the GPU memory
                     each evaluation held against its stored weights and what it left reserved once closed, and
                     what one more torch process costs the GPU against the plan's CUDA_PROCESS_BYTES; writes
                     O/device_check.json and a table

Where torch sees no CUDA device, ``run`` computes the CPU side only and says so (exit 0): that is what runs here.
Not covered, because their libraries cannot be installed there: the torch quantizers on CUDA, llama.cpp's offload
and vLLM's speed probe. A run takes about a minute on one H200.

    .venv/bin/python scripts/device_check.py prepare .device/artifacts
    PYTHONPATH=. python3 scripts/device_check.py run .device/artifacts --out "$OUT"      # on the device machine
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

FORMATS = "gptq-int4,awq,int8"
WINDOWS, CONTEXT = 2, 128
VOCAB = 4352  # the SentencePiece tokenizer's (tiny_models.SP_VOCAB_SIZE): small models that travel
# Same-model figures on two devices differ only by float32 rounding in other kernels: these bounds are far above it
# and far below any quantization's effect (on these windows the prepared INT8's KL to its reference is about 4e-3,
# the INT4s' about 0.2).
KL_BOUND, PPL_RELATIVE_BOUND, AGREEMENT_BOUND = 1e-6, 1e-4, 0.99


def prepare(folder: Path) -> None:
    """The tiny model and its packed artifacts, made by the real quantizers through the real CLI."""
    from tiny_models import build_tiny_model

    text = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    model = build_tiny_model("mistral", ROOT, folder / "model")
    run = folder / "run"
    command = [sys.executable, "-m", "quantforge.cli", "build", str(model), "--formats", FORMATS, "--out", str(run),
               "--eval-text", str(text), "--ppl-context", str(CONTEXT), "--ppl-windows", str(WINDOWS),
               "--calib-samples", "8", "--calib-seqlen", "128", "--threads", "2", "--no-speed"]  # fmt: skip
    subprocess.run(command, check=True)
    print(f"prepared {folder}: {sum(f.stat().st_size for f in folder.rglob('*') if f.is_file()) / 1e6:.1f} MB")


def random_model(kind: str, out: Path) -> Path:
    """A tiny random model of ``kind`` (tests/tiny_models' configuration) with a small vocabulary, stored in bf16."""
    import torch
    from tiny_models import _configs
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    make_config, _ = _configs()[kind]
    config = make_config()
    config.vocab_size = VOCAB
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 2, 1, 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def windows(vocab: int):
    import numpy as np

    return np.random.default_rng(0).integers(3, vocab, size=(WINDOWS, CONTEXT)).astype(np.int32)


def open_runner(folder: Path, device: str, packed: bool):
    from quantforge.dequant import float_model_from_artifact
    from quantforge.runners import TorchRunner

    if packed:
        return TorchRunner(float_model_from_artifact(folder, device=device), threads=8)
    return TorchRunner.from_folder(folder, threads=8, device=device)


def stored_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def logits_on(folder: Path, device: str, tokens, packed: bool) -> tuple[list, dict]:
    """Every window's logits from ``folder`` on ``device``, with the seconds and (CUDA) peak memory it took."""
    import torch

    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    runner = open_runner(folder, device, packed)
    logits = [runner.logits(window) for window in tokens]
    facts = {"seconds": round(time.perf_counter() - started, 3)}
    if on_cuda:
        peak = torch.cuda.max_memory_allocated(device)
        facts.update(gpu_peak_bytes=peak, gpu_peak_over_stored=round(peak / stored_bytes(folder), 2))
    runner.close()
    if on_cuda:  # close() hands torch's cached blocks back to the device, for the build's next child
        facts["gpu_reserved_after_close_bytes"] = torch.cuda.memory_reserved(device)
    return logits, facts


# A process that multiplies on the GPU, reports what torch's allocator holds, and waits to be ended.
CUDA_PROCESS = """
import json, sys, torch
a = torch.randn(1024, 1024, device="cuda:0")
(a @ a).sum().item()
print(json.dumps({"reserved": torch.cuda.memory_reserved(0)}), flush=True)
sys.stdin.read()
"""


def cuda_process_bytes() -> dict:
    """What one more torch process that has multiplied on the GPU costs the device beyond its allocator's blocks
    (context, cuBLAS, kernels), against the plan's figure: the device's used memory before it starts and while
    it waits, this process's own unchanged in between."""
    import torch

    from quantforge.resources import CUDA_PROCESS_BYTES

    def used() -> int:
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    torch.cuda.empty_cache()
    before = used()
    child = subprocess.Popen([sys.executable, "-c", CUDA_PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        reserved = json.loads(child.stdout.readline())["reserved"]
        overhead = used() - before - reserved
    finally:
        child.kill()
        child.wait()
    return {"measured_bytes": overhead, "planned_bytes": int(CUDA_PROCESS_BYTES),
            "ratio": round(overhead / CUDA_PROCESS_BYTES, 2)}  # fmt: skip


def compare(folder: Path, tokens, packed: bool, device: str | None, reference=None) -> tuple[dict, list]:
    """CPU figures of ``folder`` (and its KL to ``reference``'s windows when given), CUDA's against the CPU's; and
    the CPU's windows, a reference for what is compared with this model."""
    import numpy as np

    from quantforge.evaluate import compare_window, reference_window, summarize

    cpu, facts = logits_on(folder, "cpu", tokens, packed)
    own = [reference_window(rows, window, seed=i) for i, (rows, window) in enumerate(zip(cpu, tokens, strict=True))]
    result = {"cpu": {**facts, **summarize(np.concatenate([r.nll for r in own]))}}
    if reference is not None:
        shift = [compare_window(rows, window, ref) for rows, window, ref in zip(cpu, tokens, reference, strict=True)]
        result["cpu"]["kld_to_reference"] = float(np.mean(np.concatenate([s["kld"] for s in shift])))
    if device is None:
        return result, own
    cuda, facts = logits_on(folder, device, tokens, packed)
    same = [compare_window(rows, window, ref) for rows, window, ref in zip(cuda, tokens, own, strict=True)]
    figures = summarize(*(np.concatenate([s[key] for s in same]) for key in ("nll", "kld", "agree")))
    relative = abs(figures["perplexity"] - result["cpu"]["perplexity"]) / result["cpu"]["perplexity"]
    result["cuda"] = {
        **facts,
        "perplexity": figures["perplexity"],
        "perplexity_relative_difference": relative,
        "kld_to_cpu": figures["kld_mean"],
        "top1_agreement_with_cpu": figures["top1_agreement"],
        "max_abs_logit_difference": float(max(np.abs(a - b).max() for a, b in zip(cpu, cuda, strict=True))),
    }
    result["agrees"] = bool(
        figures["kld_mean"] < KL_BOUND
        and relative < PPL_RELATIVE_BOUND
        and figures["top1_agreement"] >= AGREEMENT_BOUND
    )
    return result, own


def device_resolution() -> dict:
    """What ``--device`` resolves to here, and the one line a device that is not there gets."""
    from quantforge.device import resolve_device
    from quantforge.errors import QuantforgeError

    facts = {"auto": resolve_device("auto")}
    try:
        facts["cuda:7"] = resolve_device("cuda:7")
    except QuantforgeError as exc:
        facts["cuda:7"] = f"error: {exc}"
    return facts


def run(prepared: Path | None, out: Path, kinds: list[str]) -> dict:
    import tempfile

    import torch

    device = "cuda:0" if torch.cuda.is_available() else None
    report: dict = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if device else None,
        "device_resolution": device_resolution(),
        "cuda_process": cuda_process_bytes() if device else None,
        "not_checked": "torch quantizers on CUDA, llama.cpp offload, vLLM speed probe (not installable there)",
        "models": {},
    }
    tokens = windows(VOCAB)
    with tempfile.TemporaryDirectory() as scratch:
        for kind in kinds:
            report["models"][kind], _ = compare(random_model(kind, Path(scratch) / kind), tokens, False, device)
    if prepared is not None:
        name = "prepared model"
        report["models"][name], reference = compare(prepared / "model", tokens, False, device)
        hf_folders = (
            folder for folder in (prepared / "run" / "artifacts").iterdir() if (folder / "config.json").exists()
        )
        for artifact in sorted(hf_folders):  # GGUF artifacts, if the build made any, are llama.cpp's to run
            name = f"{artifact.name} (packed)"
            report["models"][name], _ = compare(artifact, tokens, True, device, reference=reference)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=2))
    return report


def print_table(report: dict) -> None:
    print(f"torch {report['torch']}, GPU: {report['gpu'] or 'none visible: CPU side only'}")
    print(f"--device auto -> {report['device_resolution']['auto']}; cuda:7 -> {report['device_resolution']['cuda:7']}")
    print(f"{'model':26} {'KL to ref':>9} {'cpu ppl':>10} {'cuda ppl':>10} {'rel diff':>9} {'KL':>9} {'top1':>6} "
          f"{'gpu/stored':>10}")  # fmt: skip
    for name, entry in report["models"].items():
        cuda = entry.get("cuda", {})
        to_reference = entry["cpu"].get("kld_to_reference")
        cells = [f"{to_reference:9.2e}" if to_reference is not None else " " * 9, f"{entry['cpu']['perplexity']:10.3f}"]
        if cuda:
            cells += [f"{cuda['perplexity']:10.3f}", f"{cuda['perplexity_relative_difference']:9.1e}",
                      f"{cuda['kld_to_cpu']:9.1e}", f"{cuda['top1_agreement_with_cpu']:6.3f}",
                      f"{cuda['gpu_peak_over_stored']:10.2f}"]  # fmt: skip
        print(f"{name:26} {' '.join(cells)}{'' if entry.get('agrees', True) else '  DIFFERS'}")
    if report["cuda_process"]:
        process = report["cuda_process"]
        print(f"a torch process on the GPU beyond its tensors: {process['measured_bytes'] / 1e9:.2f} GB "
              f"(planned {process['planned_bytes'] / 1e9:.2f} GB, ratio {process['ratio']})")  # fmt: skip
    print(f"not checked: {report['not_checked']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("prepare")
    make.add_argument("folder", type=Path)
    check = sub.add_parser("run")
    check.add_argument("folder", type=Path, nargs="?")
    check.add_argument("--out", type=Path, required=True)
    check.add_argument("--architectures", default="llama,mistral,qwen2,qwen3,gemma3,phi3,qwen2_moe,olmo2")
    args = parser.parse_args()
    if args.command == "run" and args.folder is not None and not (args.folder / "run" / "artifacts").is_dir():
        parser.error(f"{args.folder} holds no prepared artifacts: run 'scripts/device_check.py prepare {args.folder}'")
    if args.command == "prepare":
        prepare(args.folder)
        return 0
    report = run(args.folder, args.out, args.architectures.split(","))
    print_table(report)
    return 0 if all(entry.get("agrees", True) for entry in report["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
