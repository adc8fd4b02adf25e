#!/usr/bin/env python3
"""Compare quantforge's HF -> GGUF converter with llama.cpp's own convert_hf_to_gguf.py, tensor by tensor.

llama.cpp's converter is taken from the vendored tree of the llama-cpp-python sdist matching the installed
version (downloaded with pip into quantforge's cache, never into this repo) and run with its own gguf-py.
Both F16 files are then quantized by llama.cpp to Q4_K_M, and those compared too.

Goal: tensor data byte-identical; metadata equal except naming keys (general.*).

    python scripts/check_gguf_parity.py                 # the bundled SmolLM2-135M
    python scripts/check_gguf_parity.py --model DIR     # any llama/mistral/qwen2/qwen3 folder
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
sys.path.insert(0, str(ROOT / "scripts"))

from llamacpp_tools import source_tree  # noqa: E402

from quantforge.backends.llamacpp import quantize_gguf  # noqa: E402
from quantforge.gguf_convert import convert_hf_to_gguf  # noqa: E402
from quantforge.source import BUNDLED  # noqa: E402

NAMING_PREFIX = "general."


def run_llama_cpp_converter(model: Path, out: Path) -> None:
    tree = source_tree()
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}  # its own gguf-py, not pip's gguf
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="HF folder (default: the bundled SmolLM2-135M)")
    parser.add_argument("--keep", type=Path, help="keep the four GGUF files in this folder")
    args = parser.parse_args()
    model = args.model or BUNDLED["smollm2-135m"](print)
    with tempfile.TemporaryDirectory() as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        ours, theirs = work / "quantforge-f16.gguf", work / "llama.cpp-f16.gguf"
        convert_hf_to_gguf(model, ours, outtype="f16", name=model.name)
        run_llama_cpp_converter(model, theirs)
        problems = compare(ours, theirs, "F16")
        for source in (ours, theirs):
            quantize_gguf(
                source, source.with_name(source.stem.replace("f16", "q4km") + ".gguf"), 15, 2, work / "quantize.log"
            )
        problems += compare(work / "quantforge-q4km.gguf", work / "llama.cpp-q4km.gguf", "Q4_K_M")
    print("PARITY OK" if problems == 0 else f"PARITY FAILED: {problems} differences")
    return 0 if problems == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
