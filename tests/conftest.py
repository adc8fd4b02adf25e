"""Shared fixtures: the real bundled SmolLM2 folder, tiny random models, and a runner for the real CLI."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
WIKITEXT = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def hugging_face_cache_kept():
    """Put the Hugging Face cache variables back after each test. A test that loads a GPTQ folder in this process
    imports GPTQModel, whose tokenicer sets HF_HOME and HF_HUB_CACHE to /tmp/tokenicer_hf_home: every later test
    that passes its own HF_HOME to a build then downloaded into (or found its repo already in) that folder. CI
    saw it: the killed-download test's build found acme/tiny-llama there and never downloaded it."""
    names = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# Builds made once by a module- or session-scoped fixture. CI runs the suite in two test processes (pytest-xdist,
# --dist loadgroup), and each process makes its own copy of a fixture that its tests use: the tests of one build
# are put in one group, so one process makes it (the mixed run was made twice, about 110 s each, and Phi-3's
# architecture run three times). A test may belong to one group: the first fixture it uses here names it.
SHARED_BUILDS = {
    "mixed_run": "mixed-run",
    "torch_run": "mixed-run",
    "both_run": "autoround-run",
    "fp8_run": "fp8-run",
    "fp4_run": "fp4-run",
    "local_release": "local-release",
    "plugin_site": "plugin-site",
    "installed": "wheel-venv",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = shared_build_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_configure(config):
    """Refuse a run whose groups pytest-xdist would lose: it tags a grouped test's node id with ``@group``, and from
    pytest 9.2 that tag no longer takes (pytest-xdist#1386), so every group was silently spread over both
    processes (our shared builds made twice, the real-shape builds run two at a time)."""
    import importlib.metadata

    from packaging.version import Version

    grouped = getattr(config.option, "dist", "no") == "loadgroup" and not os.environ.get("PYTEST_XDIST_WORKER")
    if grouped and Version(importlib.metadata.version("pytest")) >= Version("9.2"):
        raise pytest.UsageError(
            "--dist loadgroup does not group tests under pytest 9.2 or newer (pytest-xdist#1386): install the "
            "test extra's pytest (pip install -e '.[test]')"
        )


def shared_build_group(item) -> str | None:
    if "arch_run" in item.fixturenames:  # one build per architecture, made on first use
        params = getattr(item, "callspec", None)
        kind = params.params.get("kind") if params else None
        return f"arch-{kind}" if kind else None
    return next((SHARED_BUILDS[name] for name in item.fixturenames if name in SHARED_BUILDS), None)


def built_once(tmp_path_factory, name: str, make) -> Path:
    """The folder ``make(folder)`` fills, made once per session by the first test process that asks for it and
    shared with the other: pytest-xdist's processes keep their temporary folders in one folder of the session's, and
    the second process waits on the lock rather than making its own copy (same paths in both, so a run's manifest
    names the same model folder whichever process reads it). Treat the folder as read-only."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "shared" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.with_name(folder.name + ".done")
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # left by a process that failed while making it
            make(folder)
            done.touch()
    return folder


@contextlib.contextmanager
def cache_lock():
    """One test process at a time fills quantforge's user cache (the suite runs in two with pytest-xdist): two
    writing the same cached folder would each replace the other's while it is read."""
    import fcntl

    from quantforge.source import cache_root

    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M as an HF folder (dequantized once into the user's quantforge cache)."""
    from quantforge.source import BUNDLED

    with cache_lock():
        return BUNDLED["smollm2-135m"](lambda message: None)


@pytest.fixture(scope="session")
def tiny_model(smollm2_dir, tmp_path_factory):
    """tiny_model(kind) -> the folder of a tiny random model of that architecture (see tiny_models.ARCHITECTURES),
    built once per session."""
    from tiny_models import build_tiny_model, folder_name

    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            with cache_lock():  # the qwen2 model takes its tokenizer from the cache's bundled Qwen GGUF
                name = f"models/{folder_name(kind)}"
                built[kind] = built_once(tmp_path_factory, name, lambda out: build_tiny_model(kind, smollm2_dir, out))
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model) -> Path:
    return tiny_model("qwen2")


def quantforge_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 900):
    """Run the installed CLI in a subprocess, as a user would (an ``env`` value of None unsets that variable)."""
    full_env = {name: value for name, value in {**os.environ, **(env or {})}.items() if value is not None}
    return subprocess.run(
        [sys.executable, "-m", "quantforge.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# Small, fast evaluation settings for tiny-model builds: real text, few windows.
FAST_EVAL = ["--eval-text", str(WIKITEXT), "--ppl-context", "128", "--ppl-windows", "4", "--threads", "2", "--no-speed"]
TASKS_DATA = SHARED_DATA / "tasks"
TINY_FORMATS = "gguf-f16,gguf-q8_0,gguf-q4km"
# The shared tiny run also scores three lm-eval tasks on a few examples and probes decode speed.
TINY_RUN_ARGS = [
    "--formats",
    TINY_FORMATS,
    *FAST_EVAL,
    "--tasks",
    "arc_easy,winogrande,lambada",
    "--tasks-data",
    str(TASKS_DATA),
    "--limit",
    "12",
    "--speed",
    "--prompt-tokens",
    "32",
    "--gen-tokens",
    "16",
]


@pytest.fixture(scope="session")
def tiny_run(tiny_llama, tmp_path_factory) -> Path:
    """A finished build of the tiny llama into three GGUF formats (treat as read-only; copy it to change it)."""
    return built_once(tmp_path_factory, "runs/tiny", lambda out: build_run(tiny_llama, out, *TINY_RUN_ARGS))


def build_run(model: Path, out: Path, *args: str, env: dict | None = None) -> Path:
    """``quantforge build MODEL --out OUT ARGS`` that must succeed; returns the run folder."""
    result = quantforge_cli("build", str(model), "--out", str(out), *args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


CALIBRATION = ["--calib-samples", "8", "--calib-seqlen", "128"]


@pytest.fixture(scope="session")
def mixed_run(tiny_llama, tmp_path_factory) -> Path:
    """INT8, INT4 (GPTQ, AWQ) and GGUF formats of the tiny model, measured for real: the fixture the decision,
    torch-format and push tests share (one build per session)."""
    formats = "int8,gptq-int8,gptq-int4,awq,gguf-q8_0,gguf-q4km"
    args = ["--formats", formats, *FAST_EVAL, *CALIBRATION]
    return built_once(tmp_path_factory, "runs/mixed", lambda out: build_run(tiny_llama, out, *args))


def tree_digest(folder: Path) -> dict:
    """sha256 of every file below a folder, to show that a failed command changed nothing."""
    from quantforge.fsutil import file_records

    return file_records(folder)


# How closely two processes' measurements of the same model on the same windows agree (see assert_same_results):
# exactly. An earlier "5e-6 drift" between processes was looked for and not found: logits are bit-identical across
# processes, 1 or 2 threads, OMP/MKL thread settings and llama.cpp context sizes (128/600/2048, one or several
# micro-batches), for transformers and llama.cpp, on the tiny llama and SmolLM2; two builds' per-window sums are
# equal. A difference is therefore a finding: a resumed window scored wrongly, or a runtime that is not
# deterministic where it was.
RUN_TO_RUN_REL = 0.0
TIMINGS = {"decode_tps", "eval_seconds", "eval_tokens_per_second"}


def assert_same_windows(mine: dict, other: dict) -> None:
    """Window by window, the same scores: a single window scored differently fails here even where the means,
    averaged over every window, would hide it."""
    ours, theirs = mine["per_window"], other["per_window"]
    assert ours["tokens"] == theirs["tokens"], mine["key"]
    for name in ("nll", "ref_nll", "kld", "agree"):
        pairs = zip(ours[name], theirs[name], strict=True)
        for index, (a, b) in enumerate(pairs):
            assert a == pytest.approx(b, rel=RUN_TO_RUN_REL, abs=0), f"{mine['key']} window {index} {name}"


def assert_same_results(ours: dict, theirs: dict) -> None:
    """Two cards' measurements agree, format by format (speed figures are timings and always differ), and so
    does the decision, verdict by verdict."""
    assert [(e["key"], e["size_bytes"]) for e in ours["formats"]] == [
        (e["key"], e["size_bytes"]) for e in theirs["formats"]
    ]
    measured = lambda entry: {k: v for k, v in entry["metrics"].items() if k not in TIMINGS}
    for mine, other in zip(ours["formats"], theirs["formats"], strict=True):
        assert measured(mine) == pytest.approx(measured(other), rel=RUN_TO_RUN_REL, abs=0), mine["key"]
        assert_same_windows(mine, other)
    decision = lambda card: (
        card["decision"]["recommended"],
        [(v["key"], v["outcome"], v["reason"], [c["met"] for c in v["checks"]]) for v in card["decision"]["verdicts"]],
    )
    assert decision(ours) == decision(theirs)


# ----------------------------------------------------------------------------------------------- runtimes' own code

VLLM_VERSION = "0.34.0"  # the vLLM whose argument parser and quantization methods the serve commands are checked on


@pytest.fixture(scope="session")
def vllm_source():
    """vllm_source(path) -> the text of a file of vLLM's wheel (read from the zip; vLLM is never installed here).

    The wheel is fetched once with pip into quantforge's cache: it is vLLM's own source of truth for the flags and
    quantization method names we write into serve commands."""
    import zipfile

    from quantforge.source import cache_root

    folder = cache_root() / "reference"
    wheels = sorted(folder.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
        done = subprocess.run([*command, f"vllm=={VLLM_VERSION}", "-d", str(folder)], capture_output=True, text=True)
        wheels = sorted(folder.glob(f"vllm-{VLLM_VERSION}-*.whl"))
        assert wheels, f"could not fetch the vLLM {VLLM_VERSION} wheel with pip: {done.stderr[-500:]}"
    archive = zipfile.ZipFile(wheels[0])
    return lambda path: archive.read(path).decode()


def vllm_quantization_methods(vllm_source) -> set[str]:
    """The names in vLLM's QuantizationMethods literal (vllm/model_executor/layers/quantization/__init__.py)."""
    import ast

    tree = ast.parse(vllm_source("vllm/model_executor/layers/quantization/__init__.py"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "QuantizationMethods":
            return {element.value for element in node.value.slice.elts}
    raise AssertionError("vLLM's QuantizationMethods literal was not found")


def kl_against_the_serving_library(folder: Path, windows_file: Path) -> tuple[np.ndarray, str]:
    """Per-position KL(serving library || quantforge) on a run's evaluation windows, and what was compared: the
    folder loaded by the library that serves it on CPU (transformers with GPTQModel's torch kernel for GPTQ and AWQ,
    with compressed-tensors for llm-compressor's formats) against quantforge's own dequantized evaluation of the same
    folder. Issue 36: a packing or zero-point mistake in quantforge's dequantization shows here, not in a test of it
    against itself.

    INT8 W8A8 is compared on its weights alone: compressed-tensors' CPU emulation quantizes each token's activations
    with scale absmax / 127.5 (its symmetric range taken as 255 / 2), where vLLM's kernel, which serves the file,
    uses absmax / 127 (csrc/quantization/compressed_tensors/int8_quant_kernels.cu); quantforge simulates vLLM's.
    Measured on the tiny llama: with compressed-tensors' rule on both sides the logits are identical (KL 0), and so
    are the weights alone; with each side's own rule, KL up to 4.3e-3."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantforge.dequant import float_model_from_artifact

    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    weights_only = config["quant_method"] == "compressed-tensors" and any(
        (group.get("input_activations") or {}).get("type") == "int" for group in config["config_groups"].values()
    )
    windows = torch.from_numpy(np.load(windows_file)).long()
    theirs_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu").eval()
    if weights_only:
        for module in theirs_model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None:
                scheme.input_activations = None
    ours_model = float_model_from_artifact(folder, simulate_activations=not weights_only).eval()
    with torch.inference_mode():
        theirs, ours = (
            torch.cat([model(input_ids=w[None]).logits[0].double() for w in windows])
            for model in (theirs_model, ours_model)
        )
    p, q = torch.log_softmax(theirs, dim=-1), torch.log_softmax(ours, dim=-1)
    what = f"{'weights only' if weights_only else 'as served'}, the library computing in {theirs_model.dtype}"
    return (p.exp() * (p - q)).sum(-1).numpy(), what


def fp4_against_the_library(folder: Path, windows_file: Path) -> dict:
    """quantforge's FP4 (NVFP4, MXFP4) weights and simulated activations against compressed-tensors' own, op by op.

    compressed-tensors decompresses FP4 checkpoints into bfloat16 weights only (a float32 load fails in its forward),
    so a whole-model comparison would mostly measure bfloat16 arithmetic. Instead, for every quantized Linear: the
    library's decompressed weight against quantforge's float32 one rounded to bfloat16, and the library's run-time
    activation quantization (``forward_quantize``, what its emulation runs) against quantforge's simulation, both
    on the float32 input that Linear receives in quantforge's evaluation of the run's first window."""
    import functools

    import torch
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from transformers import AutoModelForCausalLM

    from quantforge.dequant import float_model_from_artifact, weight_sources

    window = torch.from_numpy(np.load(windows_file)).long()[0]
    library = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ours = float_model_from_artifact(folder).eval()
    _, sources = weight_sources(folder)
    seen: dict[str, list] = {}

    def keep(name, position, module, args):
        seen.setdefault(name, [None, None])[position] = args[0].detach().clone()

    names = [
        name
        for name, module in ours.named_modules()
        if f"{name}.weight" in sources and callable(sources[f"{name}.weight"])
    ]
    for name in names:
        module = ours.get_submodule(name)
        module.register_forward_pre_hook(functools.partial(keep, name, 0), prepend=True)  # before the simulation
        module.register_forward_pre_hook(functools.partial(keep, name, 1))  # after it
    with torch.inference_mode():
        ours(input_ids=window[None])
        library(input_ids=window[None])  # the library decompresses each weight on its first forward
    weights_differing = activations_differing = values = 0
    for name in names:
        theirs = library.get_submodule(name)
        weights_differing += int((sources[f"{name}.weight"]().to(torch.bfloat16) != theirs.weight).sum())
        raw, simulated = seen[name]
        scheme = theirs.quantization_scheme.input_activations
        expected = forward_quantize(theirs, raw, "input", scheme) if scheme is not None else raw
        activations_differing += int((expected != simulated).sum())
        values += raw.numel()
    return {
        "linears": len(names),
        "weights_differing": weights_differing,
        "activations_differing": activations_differing,
        "activation_values": values,
    }
