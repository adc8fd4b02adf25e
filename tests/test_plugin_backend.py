"""A third party's backend: one module and one entry point in a throwaway distribution, installed by pip beside
quantforge, is found by name, builds its format, is evaluated like ours and appears on the card."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import FAST_EVAL, build_run, quantforge_cli, read_json

PLUGIN_MODULE = '''
"""GGUF Q4_0 (llama.cpp's legacy 4-bit type), a format quantforge itself does not list."""
from quantforge.backends import Format
from quantforge.backends.llamacpp import GGUF_RUNTIMES, LlamaCppBackend, quantize_gguf

Q4_0 = 2  # LLAMA_FTYPE_MOSTLY_Q4_0


class Q40Backend(LlamaCppBackend):
    name = "q40-demo"
    runtimes = (*GGUF_RUNTIMES, "q40-server")  # a runtime quantforge does not know of
    formats = {"gguf-q4_0": Format("gguf-q4_0", "gguf", "Q4_0", runtimes, 4.5, "GGUF Q4_0 (plugin)", "GGUF")}

    def quantize(self, job):
        job.out.mkdir(parents=True)
        target = job.out / f"{job.source.name}-Q4_0.gguf"
        facts = quantize_gguf(job.intermediate("gguf-f16"), target, Q4_0, job.threads, job.log_dir / "q40.log")
        return {**facts, "quantizer": "q40-demo plugin"}
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """pip-installs the throwaway distribution into a folder of its own (never into the test environment)."""
    root = tmp_path_factory.mktemp("plugin")
    project = root / "project"
    (project / "qf_q40_demo").mkdir(parents=True)
    (project / "qf_q40_demo" / "__init__.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "qf-q40-demo"
            version = "0.1"

            [project.entry-points."quantforge.backends"]
            q40-demo = "qf_q40_demo:Q40Backend"
            """
        )
    )
    site = root / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    done = subprocess.run([*command, "--target", str(site), str(project)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return site


def test_the_plugin_format_is_listed_with_its_backend(plugin_site):
    result = quantforge_cli("formats", "--json", env={"PYTHONPATH": str(plugin_site)})
    assert result.returncode == 0, result.stderr
    rows = {row["format"]: row for row in json.loads(result.stdout)}
    assert rows["gguf-q4_0"]["backend"] == "q40-demo" and rows["gguf-q4_0"]["available"]
    assert "gguf-q4_0" not in {row["format"] for row in json.loads(quantforge_cli("formats", "--json").stdout)}


def test_the_plugin_format_builds_evaluates_and_is_on_the_card(plugin_site, tiny_llama, tmp_path):
    env = {"PYTHONPATH": str(plugin_site)}
    run = build_run(tiny_llama, tmp_path / "run", "--formats", "gguf-q4_0,gguf-q8_0", *FAST_EVAL, env=env)
    card = read_json(run / "card.json")
    entries = {entry["key"]: entry for entry in card["formats"]}
    plugin = entries["gguf-q4_0"]
    assert plugin["backend"] == "q40-demo" and plugin["quantize"]["quantizer"] == "q40-demo plugin"
    assert plugin["how"]["runtime"] == "llama.cpp"
    assert plugin["metrics"]["tokens_scored"] == card["reference"]["tokens_scored"]
    # 4.5 bits against 8.5 on the same windows: more of the reference's distribution is lost
    assert plugin["metrics"]["kld_mean"] > entries["gguf-q8_0"]["metrics"]["kld_mean"] > 0
    assert plugin["bits_per_weight"] < entries["gguf-q8_0"]["bits_per_weight"]
    assert "gguf-q4_0" in (run / "card.md").read_text()
    assert (run / "artifacts" / "gguf-q4_0" / "README.md").exists()  # its model card, like every artifact's
    # runtimes are those of the loaded backends: the plugin's own is a valid --runtime where the plugin is installed
    served = quantforge_cli(
        "card", str(run), "--json", "--runtime", "q40-server", "--max-ppl-increase", "1000", env=env
    )
    assert served.returncode == 0, served.stderr
    assert json.loads(served.stdout)["decision"]["recommended"] == "gguf-q4_0"
    unknown = quantforge_cli("card", str(run), "--runtime", "q40-server")
    assert unknown.returncode == 2 and "unknown runtime 'q40-server'" in unknown.stderr
