#!/usr/bin/env python3
"""Compare quantforge's GGUF path with llama.cpp's own tools run by hand, tensor by tensor.

quantforge converts with llama.cpp's convert_hf_to_gguf.py from the converter parts it keeps in its cache
(``quantforge setup``) and quantizes with llama_model_quantize; this script runs convert_hf_to_gguf.py from the
whole vendored tree of the llama-cpp-python sdist matching the installed version (downloaded with pip into
quantforge's cache, never into this repo), with its own gguf-py. Both F16 files are then quantized by llama.cpp to
Q4_K_M, and those compared too. It catches a converter cache that drifted from the runtime, and anything the
pipeline adds or loses on the way.

Goal: tensor data byte-identical; metadata equal except naming keys (general.*).

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
from quantforge.llamacpp_convert import convert_hf_to_gguf, find_converter  # noqa: E402
from quantforge.source import BUNDLED  # noqa: E402

NAMING_PREFIX = "general."


def run_llama_cpp_converter(model: Path, out: Path) -> None:
    tree = find_converter()  # llama.cpp's converter and its gguf-py, as vendored in llama-cpp-python
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


def check_model(model: Path, work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    ours, theirs = work / "quantforge-f16.gguf", work / "llama.cpp-f16.gguf"
    convert_hf_to_gguf(model, ours, outtype="f16", name=model.name)
    run_llama_cpp_converter(model, theirs)
    problems = compare(ours, theirs, f"{model.name} F16")
    for source in (ours, theirs):
        quantize_gguf(source, source.with_name(source.stem.replace("f16", "q4km") + ".gguf"), 15, 2, work / "q.log")
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
        problems = {model.name: check_model(model, work / model.name) for model in models}
    for name, count in problems.items():
        print(f"{name}: {'identical' if count == 0 else f'{count} differences'}")
    total = sum(problems.values())
    print("PARITY OK" if total == 0 else f"PARITY FAILED: {total} differences")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
