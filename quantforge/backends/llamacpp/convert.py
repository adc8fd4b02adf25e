"""Hugging Face folder -> F16 GGUF through llama.cpp's own converter, at the llama.cpp version the runtime runs.

llama.cpp's ``convert_hf_to_gguf.py`` knows over a hundred architectures and is maintained with the runtime, so
quantforge does not write GGUF files itself. The converter is taken from the sdist of the installed
``llama-cpp-python`` (its vendored ``vendor/llama.cpp``: the script, its ``conversion/`` package and its own
``gguf-py``), so the file is written by exactly the llama.cpp that later loads and quantizes it. Only those parts
are kept, in quantforge's cache; ``quantforge setup`` (run by ``scripts/install.sh``) fetches them once, so a
build works offline afterwards.

Why not auto-round's copy of the same code (``auto_round/export/export_to_gguf/conversion``): it is llama.cpp as it
was when that auto-round release was cut, which can be older or newer than the llama.cpp that runs the file, and it
is wired into auto-round's export rather than runnable on its own.

The converter runs in a child process with its own ``gguf-py`` first on the path: the pip ``gguf`` package that
quantforge uses to read files is a different release, and the converter fails with it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from functools import lru_cache
from pathlib import Path

from ... import install_hint
from ...errors import QuantforgeError

DISTRIBUTION = "llama-cpp-python"
# What the converter needs of the vendored tree: the script, its per-architecture package, its own gguf-py; and
# llama.cpp's argument table, against which tests/test_deploy.py checks the llama-server/llama-cli commands we write.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE", "common/arg.cpp")
OUT_TYPES = ("f16", "bf16", "f32")


def runtime_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise QuantforgeError(
            "GGUF formats need llama-cpp-python, which is not installed: " + install_hint("gguf")
        ) from None


def describe() -> str:
    """How the card and errors name the converter."""
    return f"llama.cpp's convert_hf_to_gguf.py (as vendored in llama-cpp-python {runtime_version()})"


def package_folder() -> Path | None:
    """The installed ``llama_cpp`` package's folder, found without importing it (its libraries, its tools' ``bin/``
    beside it and its environment are located from here)."""
    spec = importlib.util.find_spec("llama_cpp")
    return Path(spec.origin).parent if spec and spec.origin else None


def environment_shares(kind: str, version: str) -> list[Path]:
    """``share/quantforge/<kind>/<version>`` of the running environment and of the one that holds llama-cpp-python,
    when that is another (a venv that reaches its packages through a .pth line or the system's site-packages)."""
    folders = [Path(sys.prefix)]
    package = package_folder()
    if package:  # <prefix>/lib/pythonX.Y/site-packages/llama_cpp
        folders.append(package.parents[3])
    unique = list(dict.fromkeys(folder.resolve() for folder in folders))
    return [folder / "share" / "quantforge" / kind / version for folder in unique]


def converter_dirs(version: str | None = None) -> list[Path]:
    """Where the converter may be kept, most preferred first: beside the environment that holds llama-cpp-python
    (it belongs to that installation, whatever cache a run points QUANTFORGE_CACHE at), else the user's cache."""
    from ...source import cache_root

    version = version or runtime_version()
    return [*environment_shares("llama.cpp-convert", version), cache_root() / "llama.cpp-convert" / version]


def converter_dir(version: str | None = None) -> Path:
    """The folder holding the converter, or (when none does yet) where it would be installed."""
    folders = converter_dirs(version)
    found = [folder for folder in folders if (folder / "convert_hf_to_gguf.py").exists()]
    if found:
        return found[0]
    return next((folder for folder in folders if _writable(folder)), folders[-1])


def _writable(folder: Path) -> bool:
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    return os.access(existing, os.W_OK)


def _download_sdist(version: str, into: Path) -> Path:
    """The llama-cpp-python sdist of this version, through pip (the only index this may reach)."""
    into.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
    done = subprocess.run([*command, f"{DISTRIBUTION}=={version}", "-d", str(into)], capture_output=True, text=True)
    archives = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if done.returncode != 0 or not archives:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise QuantforgeError(
            f"could not fetch the llama-cpp-python {version} sdist for llama.cpp's GGUF converter ({last}); "
            "run ./scripts/install.sh (or 'quantforge setup') once where the package index can be reached"
        )
    return archives[0]


def _is_part(relative: str) -> bool:
    return any(relative == part or relative.startswith(part + "/") for part in CONVERTER_PARTS)


def install_converter(sdist: Path | None = None) -> Path:
    """Unpack the converter's parts of the sdist into the cache (atomically); return the folder."""
    from ...fsutil import partial_name, remove_path

    version = runtime_version()
    target = converter_dir(version)
    if all((target / part).exists() for part in CONVERTER_PARTS):
        return target
    scratch = partial_name(target)
    remove_path(scratch)
    scratch.mkdir(parents=True)
    try:
        archive = sdist or _download_sdist(version, scratch / "sdist")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and _is_part(m.name[len(prefix) :])]
            if not any(m.name.endswith("convert_hf_to_gguf.py") for m in members):
                raise QuantforgeError(f"{archive} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
            tar.extractall(scratch / "tree", members=members, filter="data")
        remove_path(scratch / "sdist")
        shutil.move(str(scratch / "tree" / prefix.rstrip("/")), str(scratch / "llama.cpp"))
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_path(target)  # an older install that lacks a part
        os.replace(scratch / "llama.cpp", target)
    finally:
        remove_path(scratch)
    return target


def find_converter() -> Path:
    """The installed converter folder, or a one-line error saying how to get it."""
    folder = converter_dir()
    if not (folder / "convert_hf_to_gguf.py").exists():
        raise QuantforgeError(
            f"llama.cpp's GGUF converter for llama-cpp-python {runtime_version()} is not installed "
            f"(looked in {' and '.join(str(f) for f in converter_dirs())}); "
            "run 'quantforge setup' (./scripts/install.sh does) once where the package index can be reached"
        )
    return folder


@lru_cache(maxsize=4)
def _architectures_in(folder: Path) -> frozenset[str]:
    """The HF architecture names the converter maps to a model class (its TEXT_MODEL_MAP), read without running it."""
    tree = ast.parse((folder / "conversion" / "__init__.py").read_text())
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "TEXT_MODEL_MAP":
            return frozenset(ast.literal_eval(node.value))
    raise QuantforgeError(f"{folder / 'conversion' / '__init__.py'} has no TEXT_MODEL_MAP: an unknown converter layout")


def supported_architectures() -> frozenset[str]:
    return _architectures_in(find_converter())


def architecture_problem(architecture: str | None) -> str | None:
    """Why llama.cpp's converter cannot convert this architecture, or None."""
    if architecture in supported_architectures():
        return None
    return (
        f"architecture {architecture or 'unknown'} is not one llama.cpp's GGUF converter knows "
        f"(llama.cpp as vendored in llama-cpp-python {runtime_version()}); GGUF formats cannot be made for it"
    )


# The converter runs as its own script (sys.argv, __main__) inside this wrapper, which writes the process's own
# high-water mark (VmHWM) to a file when it ends: getrusage's peak over children is the largest of every child so
# far (a speed probe's, say), so a converter smaller than an earlier child went unmeasured.
REPORTING_PEAK = """
import atexit, os, runpy, sys
report = sys.argv[1]
def write_peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            open(report, "w").write(str(int(line.split()[1]) * 1024))
atexit.register(write_peak)
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script.py` would have it
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_hf_to_gguf(
    folder: Path, out_path: Path, *, outtype: str = "f16", name: str | None = None, log_path: Path | None = None
) -> dict:
    """Write ``out_path`` (a .gguf) from the HF folder with llama.cpp's converter; return facts about it."""
    if outtype not in OUT_TYPES:
        raise QuantforgeError(f"unknown GGUF output type {outtype!r}; choose one of {', '.join(OUT_TYPES)}")
    import tempfile

    converter = find_converter()
    name = name or folder.name
    # The converter derives metadata (general.basename, size label) from the folder's *name*: it converts a view
    # of the folder named after the model, so a Hub snapshot and a local copy give the same bytes.
    with tempfile.TemporaryDirectory(prefix="quantforge-convert-") as scratch:
        view = Path(scratch) / name
        view.mkdir()
        for file in folder.iterdir():
            (view / file.name).symlink_to(file.resolve())
        script = str(converter / "convert_hf_to_gguf.py")
        peak_file = Path(scratch) / "peak"
        command = [sys.executable, "-c", REPORTING_PEAK, str(peak_file), script]
        command += [str(view), "--outtype", outtype, "--outfile", str(out_path), "--model-name", name]
        # Its own gguf-py comes first (the script puts it there itself unless NO_LOCAL_GGUF is set).
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(converter / "gguf-py"), env.get("PYTHONPATH")]))
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if peak_file.exists():
            from ...memory import note_child_peak

            note_child_peak(int(peak_file.read_text()))
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join([sys.executable, *command[4:]])}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0 or not out_path.exists():
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        where = f"; see {log_path}" if log_path else ""
        raise QuantforgeError(
            f"llama.cpp's GGUF converter (llama-cpp-python {runtime_version()}) failed: {last}{where}"
        )
    return {"converter": describe(), "outtype": outtype}
