"""Third parties' backends: each one module and one entry point in a throwaway distribution, installed by pip beside
quantforge, found by name, building its format, evaluated like ours and on the card. One writes GGUF and is timed
and served in a runtime of its own; the other writes a Hugging Face folder with a quant_method quantforge does not
know and brings the dequantizer its evaluation uses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import FAST_EVAL, build_run, quantforge_cli, read_json

PLUGIN_MODULE = '''
"""GGUF Q4_1 (llama.cpp's legacy 4-bit type), a format quantforge itself does not list, served by "q41-server"."""
import dataclasses

from quantforge.backends import Format
from quantforge.backends.llamacpp import GGUF_RUNTIMES, LlamaCppBackend, quantize_gguf
from quantforge.probe import probe_llama_cpp

Q4_1 = 3  # LLAMA_FTYPE_MOSTLY_Q4_1


class Q41Backend(LlamaCppBackend):
    name = "q41-demo"
    runtimes = (*GGUF_RUNTIMES, "q41-server")  # a runtime quantforge does not know of
    formats = {"gguf-q4_1": Format("gguf-q4_1", "gguf", "Q4_1", runtimes, 5.0, "GGUF Q4_1 (plugin)", "GGUF")}

    def quantize(self, job):
        job.out.mkdir(parents=True)
        target = job.out / f"{job.source.name}-Q4_1.gguf"
        facts = quantize_gguf(job.intermediate("gguf-f16"), target, Q4_1, job.threads, job.log_dir / "q41.log")
        return {**facts, "quantizer": "q41-demo plugin"}

    def probe_target(self, artifact_dir):
        return "q41-server", self.artifact_file(artifact_dir)

    def probe(self, runtime, path, prompt, gen_tokens, threads, runs):
        assert runtime == "q41-server"
        return {**probe_llama_cpp(path, prompt, gen_tokens, threads, runs), "server": "q41-server 0.1"}

    def deployment(self, folder, card, entry, chat):
        ours = super().deployment(folder, card, entry, chat)
        serve = ["```bash", f"q41-server --model {self.artifact_file(folder).name}", "```", ""]
        return dataclasses.replace(ours, tags=[*ours.tags, "q4_1"], usage=[*serve, *ours.usage])
'''

RTN_MODULE = '''
"""Per-output-channel int8 round-to-nearest decoder weights in a Hugging Face folder (quant_method "rtn-demo")."""
import json

from quantforge.backends import Deployment, Format
from quantforge.backends.hf import HFFolderBackend


def dequantize_rtn(tensors, prefix, quant):
    return tensors[f"{prefix}.qweight_rtn"].float() * tensors[f"{prefix}.scale_rtn"][:, None]


class RTNBackend(HFFolderBackend):
    name = "rtn-demo"
    needs_calibration = False
    formats = {"rtn-int8": Format("rtn-int8", "hf", "RTN W8A16", ("rtn-runtime",), 8.0, "int8 RTN (plugin)", "RTN")}
    dequantizers = {"rtn-demo": ("qweight_rtn", dequantize_rtn)}

    def quantize(self, job):
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(job.source.path, dtype=torch.float32)
        tensors = {}
        for name, weight in model.state_dict().items():
            prefix = name.removesuffix(".weight")
            if ".layers." in name and name.endswith("_proj.weight"):  # the decoder's Linears
                scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
                tensors[f"{prefix}.qweight_rtn"] = torch.round(weight / scale[:, None]).to(torch.int8)
                tensors[f"{prefix}.scale_rtn"] = scale
            else:
                tensors[name] = weight.clone()
        job.out.mkdir(parents=True)
        save_file(tensors, job.out / "model.safetensors")
        config = model.config.to_dict()
        config["quantization_config"] = {"quant_method": "rtn-demo", "bits": 8}
        (job.out / "config.json").write_text(json.dumps(config, indent=2))
        AutoTokenizer.from_pretrained(job.source.path).save_pretrained(job.out)
        return {"bits": 8, "quantizer": "rtn-demo plugin"}

    def deployment(self, folder, card, entry, chat):
        usage = ["```bash", f"rtn-runtime serve ./{folder.name}", "```"]
        return Deployment("transformers", ["rtn-demo"], {"quant_method": "rtn-demo", "bits": 8}, usage)
'''

# Quantizers that end their own process, the ways a real one does: GPTQModel's worker pool ends the process with
# os._exit(1) when a task raises (here a matmul of shapes that do not multiply, run on that very pool), and the
# kernel's out-of-memory killer sends SIGKILL (here sent by the process to itself, half-way through writing).
# And a runtime that aborts half-way through an evaluation (llama.cpp's own runner, then C's abort()).
CRASH_MODULE = """
import itertools
import os
import signal

from quantforge.backends import Format
from quantforge.backends.hf import HFFolderBackend
from quantforge.backends.llamacpp import GGUF_RUNTIMES, LlamaCppBackend, LlamaCppRunner, quantize_gguf


def multiply(a, b):
    return a @ b


class CrashBackend(HFFolderBackend):
    name = "crash-demo"
    requires = ("gptqmodel",)
    needs_calibration = False
    formats = {
        name: Format(name, "hf", "crash", ("transformers",), 4.0, "ends its process (test)", "CRASH")
        for name in ("crash-pool", "crash-killed")
    }

    def quantize(self, job):
        import torch

        job.out.mkdir(parents=True)
        (job.out / "model.safetensors").write_bytes(b"half")
        if job.format.name == "crash-killed":
            os.kill(os.getpid(), signal.SIGKILL)
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # GPTQModel refuses to start with one (2 cores)
        from gptqmodel import get_device_thread_pool

        task = get_device_thread_pool().submit(torch.device("cpu"), multiply, torch.ones(2, 3), torch.ones(2, 3))
        return task.result()


class AbortingRunner(LlamaCppRunner):
    # llama.cpp itself, aborting in C after its first block of logits, as it does on a failed GGML_ASSERT

    def scored_logits(self, tokens):
        yield from itertools.islice(super().scored_logits(tokens), 1)
        os.abort()


class AbortingRuntimeBackend(LlamaCppBackend):
    name = "abort-demo"
    formats = {
        "gguf-abort": Format("gguf-abort", "gguf", "Q8_0", GGUF_RUNTIMES, 8.5, "aborts in evaluation (test)", "GGUF")
    }

    def quantize(self, job):
        job.out.mkdir(parents=True)
        target = job.out / f"{job.source.name}-Q8_0.gguf"
        return quantize_gguf(job.intermediate("gguf-f16"), target, 7, job.threads, job.log_dir / "abort.log")

    def open_runner(self, artifact_dir, *, context, threads, device="cpu"):
        return AbortingRunner(self.artifact_file(artifact_dir), context=context, threads=threads, device=device)
"""


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """pip-installs the throwaway distribution into a folder of its own (never into the test environment)."""
    root = tmp_path_factory.mktemp("plugin")
    project = root / "project"
    (project / "qf_demo").mkdir(parents=True)
    (project / "qf_demo" / "__init__.py").write_text("")
    (project / "qf_demo" / "q41.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    (project / "qf_demo" / "rtn.py").write_text(textwrap.dedent(RTN_MODULE))
    (project / "qf_demo" / "crash.py").write_text(textwrap.dedent(CRASH_MODULE))
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "qf-demo-backends"
            version = "0.1"

            [project.entry-points."quantforge.backends"]
            q41-demo = "qf_demo.q41:Q41Backend"
            rtn-demo = "qf_demo.rtn:RTNBackend"
            crash-demo = "qf_demo.crash:CrashBackend"
            abort-demo = "qf_demo.crash:AbortingRuntimeBackend"
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
    assert rows["gguf-q4_1"]["backend"] == "q41-demo" and rows["gguf-q4_1"]["available"]
    assert "gguf-q4_1" not in {row["format"] for row in json.loads(quantforge_cli("formats", "--json").stdout)}


@pytest.mark.slow
def test_the_plugin_format_builds_evaluates_and_is_on_the_card(plugin_site, tiny_llama, tmp_path):
    env = {"PYTHONPATH": str(plugin_site)}
    speed = ["--speed", "--prompt-tokens", "16", "--gen-tokens", "4"]
    args = ["--formats", "gguf-q4_1,gguf-q8_0", *(a for a in FAST_EVAL if a != "--no-speed"), *speed]
    run = build_run(tiny_llama, tmp_path / "run", *args, env=env)
    card = read_json(run / "card.json")
    entries = {entry["key"]: entry for entry in card["formats"]}
    plugin = entries["gguf-q4_1"]
    assert plugin["backend"] == "q41-demo" and plugin["quantize"]["quantizer"] == "q41-demo plugin"
    assert plugin["how"]["runtime"] == "llama.cpp"
    assert plugin["metrics"]["tokens_scored"] == card["reference"]["tokens_scored"]
    # 4.5 bits against 8.5 on the same windows: more of the reference's distribution is lost
    assert plugin["metrics"]["kld_mean"] > entries["gguf-q8_0"]["metrics"]["kld_mean"] > 0
    assert plugin["bits_per_weight"] < entries["gguf-q8_0"]["bits_per_weight"]
    assert "gguf-q4_1" in (run / "card.md").read_text()
    # timed in its own runtime by its own probe (in the probe's process), ours by ours
    assert plugin["speed"]["measured"] and plugin["speed"]["runtime"] == "q41-server"
    assert plugin["speed"]["server"] == "q41-server 0.1" and plugin["speed"]["decode_tps"] > 0
    assert entries["gguf-q8_0"]["speed"]["runtime"] == "llama.cpp" and "server" not in entries["gguf-q8_0"]["speed"]
    # its model card (like every artifact's) says how to serve it, in its words and ours
    readme = (run / "artifacts" / "gguf-q4_1" / "README.md").read_text()
    assert "q41-server --model " in readme and "llama-server" in readme
    assert "- q4_1" in readme.split("---")[1] and "- gguf" in readme.split("---")[1]
    assert (run / "artifacts" / "gguf-q4_1" / "Modelfile").exists()
    assert "q41-server" not in (run / "artifacts" / "gguf-q8_0" / "README.md").read_text()
    # runtimes are those of the loaded backends: the plugin's own is a valid --runtime where the plugin is installed
    served = quantforge_cli(
        "card",
        str(run),
        "--json",
        "--runtime",
        "q41-server",
        "--max-ppl-increase",
        "1000",
        "--max-kld",
        "1000",
        env=env,
    )
    assert served.returncode == 0, served.stderr
    assert json.loads(served.stdout)["decision"]["recommended"] == "gguf-q4_1"
    unknown = quantforge_cli("card", str(run), "--runtime", "q41-server")
    assert unknown.returncode == 2 and "unknown runtime 'q41-server'" in unknown.stderr


def test_a_plugin_hf_format_is_evaluated_through_its_own_dequantizer(plugin_site, tiny_llama, tmp_path):
    env = {"PYTHONPATH": str(plugin_site)}
    run = build_run(tiny_llama, tmp_path / "run", "--formats", "rtn-int8,gguf-q4km", *FAST_EVAL, env=env)
    card = read_json(run / "card.json")
    entries = {entry["key"]: entry for entry in card["formats"]}
    rtn = entries["rtn-int8"]
    assert rtn["backend"] == "rtn-demo" and rtn["family"] == "hf" and rtn["runtimes"] == ["rtn-runtime"]
    assert rtn["how"]["runtime"].startswith("transformers (dequantized in torch)")
    assert rtn["metrics"]["tokens_scored"] == card["reference"]["tokens_scored"]
    # 8-bit per-channel weights lose some of the reference's distribution, less than 4.9-bit Q4_K_M
    assert 0 < rtn["metrics"]["kld_mean"] < entries["gguf-q4km"]["metrics"]["kld_mean"]
    readme = (run / "artifacts" / "rtn-int8" / "README.md").read_text()
    assert "rtn-runtime serve ./rtn-int8" in readme and "vllm serve" not in readme
    assert "- rtn-demo" in readme.split("---")[1] and "| weight bits | 8 |" in readme


def test_a_quantizer_that_ends_its_process_fails_its_format_and_the_build_goes_on(plugin_site, tiny_llama, tmp_path):
    env = {"PYTHONPATH": str(plugin_site)}
    run = tmp_path / "run"
    args = ["build", str(tiny_llama), "--out", str(run), "--formats", "crash-pool,crash-killed,gguf-q8_0", *FAST_EVAL]
    result = quantforge_cli(*args, env=env)
    assert result.returncode == 3, result.stderr[-3000:]  # errors.EXIT_FORMATS_FAILED: the card covers the rest
    failures = read_json(run / "run.json")["failures"]
    # GPTQModel sets the task's exception and then calls os._exit from the worker: the process usually ends first,
    # and the reason is the last traceback line GPTQModel printed into the format's log; when the waiting thread
    # wins the race, the exception comes back from the child itself. One line with the reason, either way.
    reason = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 2x3)"
    assert failures["crash-pool"]["error"] in (
        f"the quantizer's process exited with status 1 before it finished: {reason}",
        reason,
    )
    assert "killed (SIGKILL), most likely by the system for lack of memory" in failures["crash-killed"]["error"]
    for key in ("crash-pool", "crash-killed"):  # told on the terminal as one line each (rich folds it there)
        assert failures[key]["line"].startswith(f"{key}: quantize failed in GPTQModel ")
        assert f"✗ {key}: quantize failed in GPTQModel " in result.stderr
    card = read_json(run / "card.json")
    entries = {entry["key"]: entry for entry in card["formats"]}
    assert entries["crash-pool"]["failure"] == failures["crash-pool"] and "metrics" not in entries["crash-killed"]
    assert entries["gguf-q8_0"]["metrics"]["tokens_scored"] == card["reference"]["tokens_scored"]
    assert card["decision"]["recommended"] == "gguf-q8_0"
    assert sorted(p.name for p in (run / "artifacts").iterdir()) == ["gguf-q8_0"]  # nothing half-written is left
    # the same command retries only what failed
    made = read_json(run / "run.json")["stages"]["quantize/gguf-q8_0"]["started"]
    assert quantforge_cli(*args, env=env).returncode == 3
    assert read_json(run / "run.json")["stages"]["quantize/gguf-q8_0"]["started"] == made


def test_a_runtime_that_aborts_in_evaluation_fails_its_format_and_the_build_goes_on(plugin_site, tiny_llama, tmp_path):
    env = {"PYTHONPATH": str(plugin_site)}
    run = tmp_path / "run"
    args = ["build", str(tiny_llama), "--out", str(run), "--formats", "gguf-abort,gguf-q8_0", *FAST_EVAL]
    result = quantforge_cli(*args, env=env)
    assert result.returncode == 3, result.stderr[-3000:]
    failure = read_json(run / "run.json")["failures"]["gguf-abort"]
    assert failure["stage"] == "evaluate"
    assert failure["error"] == "the evaluation runtime's process was ended by SIGABRT"
    assert failure["line"].startswith("gguf-abort: evaluate failed in llama_cpp_python ")
    assert "✗ gguf-abort: evaluate failed" in result.stderr
    card = read_json(run / "card.json")
    entries = {entry["key"]: entry for entry in card["formats"]}
    assert "metrics" not in entries["gguf-abort"]
    assert entries["gguf-q8_0"]["metrics"]["tokens_scored"] == card["reference"]["tokens_scored"]
    assert card["decision"]["recommended"] == "gguf-q8_0"
    # the artifact was made and stays: the same command evaluates it again, and quantizes nothing
    stages = read_json(run / "run.json")["stages"]
    assert "evaluate/gguf-abort" not in stages
    made = stages["quantize/gguf-abort"]["started"]
    assert quantforge_cli(*args, env=env).returncode == 3
    assert read_json(run / "run.json")["stages"]["quantize/gguf-abort"]["started"] == made
