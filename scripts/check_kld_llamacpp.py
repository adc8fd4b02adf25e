#!/usr/bin/env python3
"""Cross-check quantforge's perplexity, KL divergence and top-1 agreement against llama.cpp's
`llama-perplexity --kl-divergence`.

Both sides use the same GGUF files (an F16 base and a quantized file), the same text file, the same context and
the same convention as llama-perplexity: the text tokenized by llama.cpp, chunks of n_ctx tokens, only the second
half of each chunk scored. quantforge's side runs its own code (quantforge.evaluate: top-128 reference
distribution plus the remaining mass) on logits from llama-cpp-python. Goal: within 5% of llama.cpp's figures.

    python scripts/check_kld_llamacpp.py --base F16.gguf --quant Q4_K_M.gguf --text wiki.test.raw
    python scripts/check_kld_llamacpp.py          # SmolLM2: converts and quantizes it first
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from llamacpp_tools import tool  # noqa: E402

from quantforge.backends.llamacpp import LlamaCppRunner, quantize_gguf  # noqa: E402
from quantforge.evaluate import compare_window, reference_window  # noqa: E402

TOLERANCE = 0.05


def ours(base: Path, quant: Path, text: str, n_ctx: int, chunks: int, threads: int) -> dict:
    from llama_cpp import Llama

    vocab = Llama(str(base), vocab_only=True, verbose=False)
    add_bos = vocab.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    tokens = np.asarray(vocab.tokenize(text.encode(), add_bos=add_bos, special=False), dtype=np.int32)
    vocab.close()
    chunks = min(chunks, len(tokens) // n_ctx)
    first = n_ctx // 2
    runners = {
        name: LlamaCppRunner(path, context=n_ctx, threads=threads) for name, path in (("base", base), ("quant", quant))
    }
    kld, agree, nll_base, nll_quant = [], [], [], []
    for index in range(chunks):
        window = tokens[index * n_ctx : (index + 1) * n_ctx].copy()
        if add_bos:
            window[0] = runners["base"].llm.token_bos()
        base_logits = runners["base"].logits(window)[first:]
        quant_logits = runners["quant"].logits(window)[first:]
        reference = reference_window(base_logits, window[first:])
        compared = compare_window(quant_logits, window[first:], reference)
        kld.append(compared["kld"])
        agree.append(compared["agree"])
        nll_base.append(reference.nll)
        nll_quant.append(compared["nll"])
    for runner in runners.values():
        runner.close()
    return {
        "kld": float(np.concatenate(kld).mean()),
        "top1": float(np.concatenate(agree).mean()),
        "ppl_base": float(np.exp(np.concatenate(nll_base).mean())),
        "ppl_quant": float(np.exp(np.concatenate(nll_quant).mean())),
        "chunks": chunks,
    }


def theirs(base: Path, quant: Path, text_file: Path, n_ctx: int, chunks: int, threads: int, work: Path) -> dict:
    perplexity = tool("llama-perplexity")
    logits = work / "base.kld"
    common = ["-f", str(text_file), "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(chunks), "-t", str(threads)]
    subprocess.run(
        [str(perplexity), "-m", str(base), *common, "--kl-divergence-base", str(logits)],
        check=True,
        capture_output=True,
    )
    done = subprocess.run(
        [str(perplexity), "-m", str(quant), *common, "--kl-divergence-base", str(logits), "--kl-divergence"],
        check=True,
        capture_output=True,
        text=True,
    )
    output = done.stdout + done.stderr
    kld = float(re.search(r"Mean\s+KLD:\s+([0-9.]+)", output).group(1))
    top1 = float(re.search(r"Same top p:\s+([0-9.]+)", output).group(1)) / 100
    ppl = {
        name: float(re.search(rf"Mean\s+PPL\({label}\)\s*:\s*([0-9.]+)", output).group(1))
        for name, label in (("ppl_base", "base"), ("ppl_quant", "Q"))
    }
    return {"kld": kld, "top1": top1, **ppl}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="F16 GGUF (default: SmolLM2-135M converted by quantforge)")
    parser.add_argument("--quant", type=Path, help="quantized GGUF (default: Q4_K_M of the base)")
    parser.add_argument(
        "--text", type=Path, default=ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    )
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        base, quant = args.base, args.quant
        if base is None:
            from quantforge.backends.llamacpp.convert import convert_hf_to_gguf
            from quantforge.source import BUNDLED

            base = work / "smollm2-f16.gguf"
            convert_hf_to_gguf(BUNDLED["smollm2-135m"](print), base)
        if quant is None:
            quant = work / "quant-q4km.gguf"
            quantize_gguf(base, quant, 15, args.threads, work / "quantize.log")
        text = args.text.read_text(encoding="utf-8")
        mine = ours(base, quant, text, args.ctx, args.chunks, args.threads)
        reference = theirs(base, quant, args.text, args.ctx, mine["chunks"], args.threads, work)
    for name, label in (("ppl_base", "perplexity, base"), ("ppl_quant", "perplexity, quant")):
        print(
            f"{label}: quantforge {mine[name]:.4f}  llama.cpp {reference[name]:.4f}  "
            f"ratio {mine[name] / reference[name]:.4f}"
        )
    kld_ratio = mine["kld"] / reference["kld"]
    top1_ratio = mine["top1"] / reference["top1"]
    print(f"{mine['chunks']} chunks of {args.ctx} tokens, second half of each scored")
    print(f"mean KLD:      quantforge {mine['kld']:.6f}  llama.cpp {reference['kld']:.6f}  ratio {kld_ratio:.4f}")
    print(f"top-1 agreement: quantforge {mine['top1']:.4f}  llama.cpp {reference['top1']:.4f}  ratio {top1_ratio:.4f}")
    ppl_ratios = [mine[name] / reference[name] for name in ("ppl_base", "ppl_quant")]
    ok = all(abs(r - 1) <= TOLERANCE for r in (kld_ratio, top1_ratio, *ppl_ratios))
    print("WITHIN 5%" if ok else "OUTSIDE 5%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
