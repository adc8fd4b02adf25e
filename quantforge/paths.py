"""Where the project's definition folders live (recipes/, calibration/, evals/), next to the package."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def definition_dirs(kind: str) -> list[Path]:
    """Folders searched for definitions of ``kind`` ("recipes", "calibration", "evals/text", "evals/tasks").

    QUANTFORGE_PATH (os.pathsep-separated project roots) comes first, so a team can keep its own recipes.
    """
    roots = [Path(p) for p in os.environ.get("QUANTFORGE_PATH", "").split(os.pathsep) if p]
    roots.append(PROJECT_ROOT)
    return [root / kind for root in roots if (root / kind).is_dir()]


def find_definitions(*kinds: str) -> dict[str, Path]:
    """Definition name -> YAML file, the first found winning (QUANTFORGE_PATH roots before the project's)."""
    found: dict[str, Path] = {}
    for kind in kinds:
        for folder in definition_dirs(kind):
            for path in sorted(folder.glob("*.yaml")):
                found.setdefault(path.stem, path)
    return found
