"""Where the definition folders live: recipes/, calibration/, evals/ (YAML files, one definition each).

Three places, searched in this order, the first definition of a name winning:
1. the project roots in QUANTFORGE_PATH (os.pathsep-separated), so a team can keep and override its own;
2. the source checkout's top-level folders, when quantforge runs from one (an editable install, the tests);
3. the copies shipped inside the package (quantforge/definitions/..., see pyproject.toml), for a wheel install.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DEFINITIONS = Path(__file__).resolve().parent / "definitions"
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def _roots() -> list[Path]:
    roots = [Path(p) for p in os.environ.get("QUANTFORGE_PATH", "").split(os.pathsep) if p]
    # a checkout is recognised by its pyproject.toml, so a stray site-packages/recipes folder is never read
    if (SOURCE_ROOT / "pyproject.toml").is_file():
        roots.append(SOURCE_ROOT)
    roots.append(PACKAGE_DEFINITIONS)
    return roots


def definition_dirs(kind: str) -> list[Path]:
    """Folders searched for definitions of ``kind`` ("recipes", "calibration", "evals/text", "evals/tasks")."""
    return [root / kind for root in _roots() if (root / kind).is_dir()]


def find_definitions(*kinds: str) -> dict[str, Path]:
    """Definition name -> YAML file, the first found winning (QUANTFORGE_PATH roots first)."""
    found: dict[str, Path] = {}
    for kind in kinds:
        for folder in definition_dirs(kind):
            for path in sorted(folder.glob("*.yaml")):
                found.setdefault(path.stem, path)
    return found
