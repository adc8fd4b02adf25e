"""The built wheel works on its own: definitions ship inside it, and a non-editable install finds them.

The wheel is installed with --no-deps into a fresh venv whose dependencies come from this test's environment
through a .pth line (a path added that way is not scanned for .pth files, so the editable install of the checkout
is not seen); commands run from a folder outside the checkout so nothing there can be imported by accident.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_PARTS = ("pyproject.toml", "README.md", "quantforge", "recipes", "calibration", "evals")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for part in SOURCE_PARTS:
        copy = shutil.copytree if (REPO / part).is_dir() else shutil.copy2
        copy(
            REPO / part,
            source / part,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        cwd=source,
    )
    return next(out.glob("quantforge_llm-*.whl"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel (not editable); returns its bin folder."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(root)  # ensurepip: offline
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
    )
    return root / "bin"


def _run(bin_dir: Path, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(cwd), "QUANTFORGE_PATH": "", **(env or {})}
    return subprocess.run([str(bin_dir / "quantforge"), *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_a_wheel_install_builds_the_bundled_model_offline(installed, tmp_path):
    """The installed wheel alone runs the README's job (one format, one short window: the install is under test,
    not the figures). llama-cpp-python sits in another environment here (reached through the .pth line), and the
    converter is found beside it, as the tools are. The user's cache (the bundled model's dequantized folder) is
    shared with the test environment's."""
    from quantforge.source import cache_root

    out = tmp_path / "run"
    env = {"QUANTFORGE_CACHE": str(cache_root()), "HF_HUB_OFFLINE": "1"}
    args = ["--formats", "gguf-q8_0", "--ppl-windows", "1", "--ppl-context", "64", "--no-speed", "--out", str(out)]
    result = _run(installed, "build", "smollm2-135m", *args, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.loads((out / "card.json").read_text())
    assert [(e["key"], e["complete"]) for e in card["formats"]] == [("gguf-q8_0", True)]
    assert card["provenance"]["command"].startswith("quantforge build smollm2-135m")


def test_the_wheel_holds_every_definition(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for kind in ("recipes", "calibration", "evals/tasks", "evals/text"):
        shipped = {Path(n).name for n in names if n.startswith(f"quantforge/definitions/{kind}/")}
        assert shipped == {p.name for p in (REPO / kind).glob("*.yaml")}, kind


def test_the_wheel_is_named_for_pypi_and_caps_only_in_extras(wheel):
    """Issue 39: "quantforge" on PyPI is another project, and a user who makes GGUF files alone must not be held to
    the torch and transformers that llm-compressor and GPTQModel pin."""
    from packaging.requirements import Requirement

    archive = zipfile.ZipFile(wheel)
    metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    headers = [line.split(": ", 1) for line in metadata.splitlines() if ": " in line]
    assert dict(headers)["Name"] == "quantforge-llm"
    core = [Requirement(value) for key, value in headers if key == "Requires-Dist" and "extra ==" not in value]
    for requirement in core:
        assert all(spec.operator == ">=" for spec in requirement.specifier), requirement
    assert {"torch", "transformers", "httpx"} <= {r.name for r in core}
    capped = [Requirement(v) for k, v in headers if k == "Requires-Dist" and "extra ==" in v and "torch<" in v]
    assert capped, "the extras that need torch < 2.14 say so"


def test_a_wheel_install_lists_formats_recipes_and_tasks(installed, tmp_path):
    located = subprocess.run(
        [str(installed / "python"), "-c", "import quantforge, sys; print(quantforge.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    ).stdout
    assert str(installed.parent) in located, "the wheel's copy must be the one imported"
    formats = _run(installed, "formats", "--json", cwd=tmp_path)
    assert formats.returncode == 0, formats.stderr
    assert {"gguf-q4km", "awq", "int8"} <= {row["format"] for row in json.loads(formats.stdout)}
    listed = _run(installed, "definitions", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    found = json.loads(listed.stdout)
    assert {"qwen2.5-7b", "smollm2-135m"} <= set(found["recipes"])
    assert {"arc_easy", "hellaswag"} <= set(found["tasks"])
    assert {"wikitext2", "pydoc"} <= set(found["texts"])
    for kind in found.values():
        for path in kind.values():
            assert path.startswith(str(installed.parent)), path  # read from the installed package, not the checkout
    plan = _run(installed, "build", "qwen2.5-7b", "--formats", "gguf-q4km", "--plan-only", "--json", cwd=tmp_path)
    assert plan.returncode in (0, 2), plan.stderr
    assert "unknown model" not in plan.stderr


def test_a_team_path_still_adds_and_overrides_definitions(installed, tmp_path):
    team = tmp_path / "team"
    (team / "recipes").mkdir(parents=True)
    (team / "recipes" / "ours.yaml").write_text("name: ours\nmodel: org/ours\n")
    env_path = {"QUANTFORGE_PATH": str(team)}
    result = subprocess.run(
        [str(installed / "quantforge"), "definitions", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": f"{installed}:/usr/bin:/bin", "HOME": str(tmp_path), **env_path},
    )
    assert result.returncode == 0, result.stderr
    recipes = json.loads(result.stdout)["recipes"]
    assert recipes["ours"] == str(team / "recipes" / "ours.yaml")
    assert "qwen2.5-7b" in recipes
