#!/usr/bin/env python3
"""Write the tiny random models (llama, qwen2) the examples and tests use into a folder.

python scripts/make_tiny_models.py examples/models
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import build_tiny_model  # noqa: E402

from quantforge.source import BUNDLED  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "examples" / "models")
    tokenizer = BUNDLED["smollm2-135m"](print)
    for kind in ("llama", "qwen2"):
        print(build_tiny_model(kind, tokenizer, out / f"tiny-{kind}"))
