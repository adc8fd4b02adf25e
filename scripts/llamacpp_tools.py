"""llama.cpp's own command-line tools for the benchmarks (llama-perplexity, llama-bench, ...): built once by
quantforge.backends.llamacpp.tools from the vendored tree of the installed llama-cpp-python, with the flags
scripts/install.sh uses for the Python package, so that timings compare like with like.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantforge.backends.llamacpp.tools import build_tools  # noqa: E402


def tool(name: str) -> Path:
    """Path to a built llama.cpp tool (built on first use: several CPU-minutes)."""
    return build_tools((name,), log=lambda line: print(line, file=sys.stderr))[name]


if __name__ == "__main__":
    for name in sys.argv[1:] or ["llama-perplexity", "llama-bench"]:
        print(tool(name))
