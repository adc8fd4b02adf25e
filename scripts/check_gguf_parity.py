#!/usr/bin/env python3
"""Compare quantforge's GGUF path with llama.cpp's own tools run by hand, byte for byte.

quantforge's side: ``quantforge.backends.llamacpp.convert.convert_hf_to_gguf`` (the converter parts quantforge
keeps in its cache) and ``quantize_gguf`` (llama_model_quantize through llama-cpp-python), as a build runs them.

llama.cpp's side, which shares none of that code path: convert_hf_to_gguf.py run from the *whole* vendored tree of
the llama-cpp-python sdist matching the installed version (fetched with pip into a scratch folder, never into this
repo), with that tree's own gguf-py, and llama.cpp's ``llama-quantize`` program (built from the same tree by
``quantforge setup --tools``). It catches a converter cache that drifted from the runtime, a quantizer call with
other parameters than llama.cpp's own program uses, and anything the pipeline adds or loses on the way.

Goal: tensor data byte-identical; metadata equal except naming keys (general.*). Measured on SmolLM2-135M
(llama-cpp-python 0.3.36): F16 and Q4_K_M 272 of 272 tensors byte-identical, 30 metadata keys equal, only
general.name differs.

    python scripts/check_gguf_parity.py                      # the bundled SmolLM2-135M
    python scripts/check_gguf_parity.py --model DIR [--model DIR2 ...]
    python scripts/check_gguf_parity.py --tiny-all           # every architecture of the tests (tests/tiny_models.py)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantforge.backends.llamacpp import quantize_gguf  # noqa: E402
from quantforge.backends.llamacpp.convert import convert_hf_to_gguf  # noqa: E402
from quantforge.backends.llamacpp.tools import require_tool, source_tree  # noqa: E402
from quantforge.source import BUNDLED  # noqa: E402

NAMING_PREFIX = "general."
Q4_K_M = 15  # llama_ftype's number for quantforge's call; llama-quantize takes the name


def run_llama_cpp_converter(tree: Path, model: Path, out: Path) -> None:
    """convert_hf_to_gguf.py from llama.cpp's whole source tree, with the tree's own gguf-py (not pip's gguf)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
    result = subprocess.run(
        [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model), "--outtype", "f16", "--outfile", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        sys.exit(f"llama.cpp's converter failed:\n{result.stderr[-3000:]}")


def read_gguf(path: Path) -> tuple[dict, dict]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        metadata[key] = value
    tensors = {
        t.name: (
            t.tensor_type.name,
            tuple(int(x) for x in t.shape),
            hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest(),
        )
        for t in reader.tensors
    }
    return metadata, tensors


def compare(ours: Path, theirs: Path, label: str) -> int:
    our_meta, our_tensors = read_gguf(ours)
    their_meta, their_tensors = read_gguf(theirs)
    problems = 0
    only = set(our_tensors) ^ set(their_tensors)
    for name in sorted(only):
        print(f"  [{label}] tensor {name} only in {'quantforge' if name in our_tensors else 'llama.cpp'}")
        problems += 1
    identical = 0
    for name in sorted(set(our_tensors) & set(their_tensors)):
        if our_tensors[name] == their_tensors[name]:
            identical += 1
        else:
            problems += 1
            print(f"  [{label}] tensor {name} differs: {our_tensors[name][:2]} vs {their_tensors[name][:2]}")
    print(f"[{label}] tensors: {identical} of {len(their_tensors)} byte-identical")
    meta_keys = set(our_meta) | set(their_meta)
    naming = sorted(k for k in meta_keys if k.startswith(NAMING_PREFIX) and our_meta.get(k) != their_meta.get(k))
    differing = sorted(k for k in meta_keys if not k.startswith(NAMING_PREFIX) and our_meta.get(k) != their_meta.get(k))
    for key in differing:
        problems += 1
        print(
            f"  [{label}] metadata {key}: quantforge={str(our_meta.get(key))[:80]!r} "
            f"llama.cpp={str(their_meta.get(key))[:80]!r}"
        )
    print(
        f"[{label}] metadata: {len(meta_keys) - len(naming) - len(differing)} keys equal, "
        f"{len(differing)} differ, {len(naming)} naming keys differ ({', '.join(naming) or 'none'})"
    )
    return problems


def run_llama_quantize(source: Path, out: Path) -> None:
    """llama.cpp's own quantizer program, as its README runs it."""
    command = [str(require_tool("llama-quantize")), str(source), str(out), "Q4_K_M", "2"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"llama-quantize failed:\n{result.stderr[-3000:]}")


def check_model(tree: Path, model: Path, work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    ours, theirs = work / "quantforge-f16.gguf", work / "llama.cpp-f16.gguf"
    convert_hf_to_gguf(model, ours, outtype="f16", name=model.name)
    run_llama_cpp_converter(tree, model, theirs)
    problems = compare(ours, theirs, f"{model.name} F16")
    quantize_gguf(ours, work / "quantforge-q4km.gguf", Q4_K_M, 2, work / "q.log")
    run_llama_quantize(theirs, work / "llama.cpp-q4km.gguf")
    return problems + compare(work / "quantforge-q4km.gguf", work / "llama.cpp-q4km.gguf", f"{model.name} Q4_K_M")


def tiny_models(folder: Path) -> list[Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import ARCHITECTURES, build_tiny_model, folder_name

    smollm2 = BUNDLED["smollm2-135m"](print)
    return [build_tiny_model(kind, smollm2, folder / folder_name(kind)) for kind in ARCHITECTURES]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", help="HF folder (default: the bundled SmolLM2-135M)")
    parser.add_argument("--tiny-all", action="store_true", help="every tiny test architecture (tests/tiny_models.py)")
    parser.add_argument("--keep", type=Path, help="keep the GGUF files in this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.keep or Path(scratch)
        models = list(args.model or [])
        if args.tiny_all:
            models += tiny_models(work / "models")
        models = models or [BUNDLED["smollm2-135m"](print)]
        tree = source_tree(Path(scratch) / "llama.cpp-source")
        print(f"llama.cpp's side: {tree / 'convert_hf_to_gguf.py'} and {require_tool('llama-quantize')}")
        problems = {model.name: check_model(tree, model, work / model.name) for model in models}
    for name, count in problems.items():
        print(f"{name}: {'identical' if count == 0 else f'{count} differences'}")
    total = sum(problems.values())
    print("PARITY OK" if total == 0 else f"PARITY FAILED: {total} differences")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
