"""llama.cpp's own command-line tools (llama-perplexity, llama-bench), built once from the vendored tree of the
installed llama-cpp-python's sdist into quantforge's cache, with the same CPU flags as scripts/install.sh uses for
the Python package, so that timings compare like with like. Nothing of llama.cpp is kept in this repository.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantforge.source import cache_root  # noqa: E402

CMAKE_FLAGS = [
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
]


def source_tree() -> Path:
    version = importlib.metadata.version("llama-cpp-python")
    base = cache_root() / "llama-cpp-python-src"
    tree = base / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not tree.exists():
        base.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={version}",
                "-d",
                str(base),
            ],
            check=True,
            capture_output=True,
        )
        with tarfile.open(base / f"llama_cpp_python-{version}.tar.gz") as archive:
            archive.extractall(base, filter="data")
    return tree


def tool(name: str) -> Path:
    """Path to a built llama.cpp tool (built on first use: several CPU-minutes)."""
    tree = source_tree()
    build = tree.parent.parent.parent / "build-tools"
    binary = build / "bin" / name
    if not binary.exists():
        print(f"building {name} from {tree} (once; several minutes)", file=sys.stderr)
        subprocess.run(
            ["cmake", "-S", str(tree), "-B", str(build), *CMAKE_FLAGS], check=True, stdout=subprocess.DEVNULL
        )
        subprocess.run(
            ["cmake", "--build", str(build), "--target", name, "-j", str(os.cpu_count() or 2)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return binary


if __name__ == "__main__":
    for name in sys.argv[1:] or ["llama-perplexity", "llama-bench"]:
        print(tool(name))
