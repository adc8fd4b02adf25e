"""The code's lint and format, as ruff (configured in pyproject.toml) checks them: CI runs them through the suite."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

CHECKED = ["quantforge", "tests", "scripts"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *CHECKED], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def _imports(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at module level or inside functions (read from the source)."""
    graph = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        home = name if parts[-1] == "__init__" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = home.split(".")[: len(home.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                found |= {target, *(f"{target}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = found
    return {name: {other for other in found if other in graph and other != name} for name, found in graph.items()}


def test_the_package_has_no_import_cycle():
    """Issue 40: no two modules import each other, even lazily (a cycle hidden in a function is still a tangle)."""
    graph = _imports(REPO / "quantforge")

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen))
                   for nxt in graph[start])  # fmt: skip

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert not cycles, cycles
