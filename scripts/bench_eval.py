#!/usr/bin/env python3
"""Evaluation throughput and the speed probe, against the reference tools, in one session on this machine.

1. Perplexity, torch: quantforge's evaluation (NLL, KL against the stored reference, top-1) of the float model
   against a plain batched transformers forward that computes only the NLL over the same windows. Goal >= 0.9x.
2. Perplexity, GGUF: quantforge's evaluation of a GGUF (llama-cpp-python) against llama.cpp's own
   llama-perplexity on the same file, text and context (tokens processed per second). Goal >= 0.9x.
3. Speed probe against llama-bench on the same file and thread count (prompt and decode tok/s). Goal: within 5%.

    python scripts/bench_eval.py                       # SmolLM2-135M, Q4_K_M
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from llamacpp_tools import tool  # noqa: E402

from quantforge.backends.llamacpp import LlamaCppRunner, quantize_gguf  # noqa: E402
from quantforge.evaluate import make_windows, score_artifact, score_reference, tokenize_text  # noqa: E402
from quantforge.runners import TorchRunner  # noqa: E402


def plain_transformers_nll(model_dir: Path, windows: np.ndarray, threads: int, batch: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():  # warm-up, untimed: quantforge's side is timed warm too
        model(input_ids=torch.as_tensor(windows[:batch], dtype=torch.long))
    started = time.perf_counter()
    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(windows), batch):
            ids = torch.as_tensor(windows[start : start + batch], dtype=torch.long)
            logits = model(input_ids=ids).logits[:, :-1].float()
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            ).item()
    return windows.size / (time.perf_counter() - started)


def llama_perplexity_tps(gguf: Path, text: Path, n_ctx: int, chunks: int, threads: int) -> float:
    """Tokens per second of llama-perplexity's evaluation: the wall time of N chunks minus that of one chunk,
    so model loading and tokenizing the text cancel out."""

    def seconds(n: int) -> float:
        started = time.perf_counter()
        subprocess.run(
            [
                str(tool("llama-perplexity")),
                "-m",
                str(gguf),
                "-f",
                str(text),
                "-c",
                str(n_ctx),
                "-b",
                str(n_ctx),
                "--chunks",
                str(n),
                "-t",
                str(threads),
                "-fa",
                "off",  # as quantforge evaluates (flash_attn=False); llama-perplexity's default is 'auto'
            ],
            capture_output=True,
            check=True,
        )
        return time.perf_counter() - started

    return (chunks - 1) * n_ctx / (seconds(chunks) - seconds(1))


def llama_bench(gguf: Path, prompt: int, gen: int, threads: int) -> dict:
    # Flash attention off, as the probe runs it; the decode test starts at a depth of `prompt` tokens, as the
    # probe decodes after its prompt.
    common = ["-m", str(gguf), "-t", str(threads), "-r", "3", "-fa", "0", "-o", "json"]
    done = subprocess.run(
        [str(tool("llama-bench")), *common, "-p", str(prompt), "-n", "0"], capture_output=True, text=True, check=True
    )
    decode = subprocess.run(
        [str(tool("llama-bench")), *common, "-p", "0", "-n", str(gen), "-d", str(prompt)],
        capture_output=True,
        text=True,
        check=True,
    )
    return {"prompt": json.loads(done.stdout)[0]["avg_ts"], "decode": json.loads(decode.stdout)[0]["avg_ts"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="HF folder (default: bundled SmolLM2-135M)")
    parser.add_argument(
        "--text", type=Path, default=ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    )
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    args = parser.parse_args()
    from quantforge.backends.llamacpp.convert import convert_hf_to_gguf
    from quantforge.source import BUNDLED

    model = args.model or BUNDLED["smollm2-135m"](print)
    windows = make_windows(tokenize_text(model, args.text.read_text(), args.ctx * args.windows), args.ctx, args.windows)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        f16, q4 = work / "model-f16.gguf", work / "model-q4km.gguf"
        convert_hf_to_gguf(model, f16)
        quantize_gguf(f16, q4, 15, args.threads, work / "quantize.log")

        runner = TorchRunner.from_folder(model, threads=args.threads)
        refs, reference = score_reference(runner.logits, windows)
        ours_torch = score_artifact(runner.logits, windows, refs)["eval_tokens_per_second"]
        runner.close()
        plain = max(plain_transformers_nll(model, windows, args.threads, batch) for batch in (1, 4))
        print(
            f"perplexity, torch: quantforge {ours_torch:.0f} tok/s, plain transformers {plain:.0f} tok/s, "
            f"ratio {ours_torch / plain:.3f} (goal >= 0.9)"
        )

        llama = LlamaCppRunner(q4, context=args.ctx, threads=args.threads)
        llama.logits(windows[0])  # warm-up, untimed (llama-perplexity's first chunk is subtracted out)
        ours_gguf = score_artifact(llama.logits, windows, refs)["eval_tokens_per_second"]
        llama.close()
        theirs = llama_perplexity_tps(q4, args.text, args.ctx, args.windows, args.threads)
        print(
            f"perplexity, GGUF Q4_K_M: quantforge {ours_gguf:.0f} tok/s, llama-perplexity {theirs:.0f} tok/s, "
            f"ratio {ours_gguf / theirs:.3f} (goal >= 0.9)"
        )
        prompt = work / "prompt.npy"
        np.save(prompt, windows[0][: args.prompt_tokens])
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "quantforge.probe_process",
                "--runtime",
                "llama.cpp",
                "--path",
                str(q4),
                "--prompt",
                str(prompt),
                "--gen-tokens",
                str(args.gen_tokens),
                "--threads",
                str(args.threads),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        probe = json.loads(done.stdout.strip().splitlines()[-1])
        bench = llama_bench(q4, args.prompt_tokens, args.gen_tokens, args.threads)
        print(
            f"probe vs llama-bench: prompt {probe['prompt_tps']:.0f} vs {bench['prompt']:.0f} tok/s "
            f"(ratio {probe['prompt_tps'] / bench['prompt']:.3f}); decode {probe['decode_tps']:.1f} vs "
            f"{bench['decode']:.1f} tok/s (ratio {probe['decode_tps'] / bench['decode']:.3f}) (goal: within 5%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
