"""llama.cpp's own command-line tools (``llama-imatrix``, ``llama-quantize``, and for benchmarks
``llama-perplexity``, ``llama-bench``), built from the vendored tree of the installed llama-cpp-python's sdist.

Why build them: an importance matrix reaches llama.cpp's quantizer only as a C++ map (``llama_model_quantize_params
.imatrix`` is a ``std::unordered_map*``), which Python cannot hand over; and the matrix is collected by ggml's eval
callback inside ``llama-imatrix``. Running llama.cpp's own programs, from the same source as the library that later
loads the files, is what users of imatrix GGUFs compare against.

Where they come from, first found first:
- the llama-cpp-python wheel itself. ``scripts/install.sh`` builds that package with llama.cpp's tools switched on,
  so that one compile makes the library Python loads and the tools, linked against the very same shared libraries
  (the wheel's ``bin/`` and ``lib/``, beside ``llama_cpp/``);
- a separate static build of the same vendored source (one file each, no rpath into a build tree), kept beside
  the environment like the converter: ``quantforge setup --tools``, or on first use, when the installed package
  was built without them (a plain ``pip install llama-cpp-python``). ``CMAKE_ARGS`` adds flags there too, e.g.
  ``-DGGML_CUDA=on``.
"""

from __future__ import annotations

import os
import shlex
import sys
import tarfile
from pathlib import Path

from ...errors import QuantforgeError
from ...logs import run_logged
from .convert import _download_sdist, _writable, environment_shares, package_folder, runtime_version

PRODUCT_TOOLS = ("llama-imatrix", "llama-quantize")
# What 'quantforge setup --tools' builds: the product's tools and llama-perplexity, the independent side of the
# perplexity checks (tests, scripts/): in the same build it adds about a minute, on its own it would be a whole one.
SETUP_TOOLS = (*PRODUCT_TOOLS, "llama-perplexity")
# Plain AVX2 as scripts/install.sh builds the Python package (the native build's AMX kernels crash on our VMs).
CMAKE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)


def package_tool_dir() -> Path | None:
    """The ``bin/`` of the installed llama-cpp-python wheel (found without importing it), where its own build put
    llama.cpp's tools when it was built with them."""
    package = package_folder()
    return package.parent / "bin" if package else None


def tool_dirs(version: str | None = None) -> list[Path]:
    """Where the tools we build are kept, most preferred first (as for the converter: beside the environment)."""
    from ...source import cache_root

    version = version or runtime_version()
    return [*environment_shares("llama.cpp-tools", version), cache_root() / "llama.cpp-tools" / version]


def find_tool(name: str) -> Path | None:
    """The package's own tool, else one we built; None when neither is there."""
    folders = [folder for folder in (package_tool_dir(), *tool_dirs()) if folder is not None]
    return next((folder / name for folder in folders if (folder / name).is_file()), None)


def require_tool(name: str) -> Path:
    """The built tool, or a one-line error saying how to build it."""
    found = find_tool(name)
    if found is None:
        raise QuantforgeError(
            f"llama.cpp's {name} is not built for llama-cpp-python {runtime_version()}; "
            "run 'quantforge setup --tools' once (several minutes; ./scripts/install.sh does it)"
        )
    return found


def source_tree(scratch: Path, sdist: Path | None = None) -> Path:
    """The whole vendored llama.cpp of the installed llama-cpp-python, unpacked under ``scratch``."""
    version = runtime_version()
    archive = sdist or _download_sdist(version, scratch / "sdist")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [member for member in tar.getmembers() if member.name.startswith(prefix)]
        if not members:
            raise QuantforgeError(f"{archive} holds no vendor/llama.cpp")
        tar.extractall(scratch / "tree", members=members, filter="data")
    return scratch / "tree" / prefix.rstrip("/")


def build_tools(names: tuple[str, ...] = PRODUCT_TOOLS, sdist: Path | None = None, log=print) -> dict[str, Path]:
    """Build the named tools that are missing (several CPU-minutes), install them atomically, return their paths."""
    from ...fsutil import partial_name, remove_path

    missing = [name for name in names if find_tool(name) is None]
    if missing:
        cmake = cmake_path()
        folders = tool_dirs()
        target = next((folder for folder in folders if _writable(folder)), folders[-1])
        scratch = partial_name(target)
        remove_path(scratch)
        scratch.mkdir(parents=True)
        try:
            log(f"building llama.cpp's {', '.join(missing)} (once; several minutes)")
            tree = source_tree(scratch, sdist)
            build = scratch / "build"
            extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
            jobs = str(os.cpu_count() or 2)
            # the log stays beside the tools (the scratch tree goes), so a failed build's error can name it
            log_path, what = target.parent / f"build-{target.name}.log", "building llama.cpp's tools"
            run_logged([cmake, "-S", str(tree), "-B", str(build), *CMAKE_FLAGS, *extra], log_path, what)
            run_logged([cmake, "--build", str(build), "--target", *missing, "-j", jobs], log_path, what)
            target.mkdir(parents=True, exist_ok=True)
            for name in missing:
                staged = partial_name(target / name)
                os.replace(build / "bin" / name, staged)
                os.replace(staged, target / name)
        finally:
            remove_path(scratch)
    return {name: require_tool(name) for name in names}


def cmake_path() -> str:
    """cmake from this environment (pip install cmake) or the system, or a one-line error saying how to get it."""
    import shutil

    beside = Path(sys.executable).parent / "cmake"
    found = str(beside) if beside.exists() else shutil.which("cmake")
    if found is None:
        raise QuantforgeError(
            "building llama.cpp's tools needs cmake and a C++ compiler: pip install cmake (and install g++), "
            "then run 'quantforge setup --tools'"
        )
    return found
