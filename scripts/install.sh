#!/usr/bin/env bash
# Install quantforge and everything its formats need into .venv (idempotent: a second run is quick).
#   ./scripts/install.sh        the product
#   ./scripts/install.sh test   also what the tests need beyond Python: Go (its text/template renders Ollama
#                               TEMPLATEs exactly as Ollama does), from the system's packages when it is missing
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# An NVIDIA GPU here (nvidia-smi lists one): the CUDA build of torch, and llama.cpp built with CUDA when nvcc is
# present. QUANTFORGE_TORCH_INDEX picks the index torch comes from (e.g. https://download.pytorch.org/whl/cpu for a
# CPU-only machine without a local CPU wheel, or a CUDA-version index of PyTorch's).
gpu=no
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then gpu=yes; fi
torch_index=()
if [ -n "${QUANTFORGE_TORCH_INDEX:-}" ]; then torch_index=(--index-url "$QUANTFORGE_TORCH_INDEX");
elif [ "$gpu" = yes ]; then torch_index=(--index-url https://pypi.org/simple); fi   # PyPI's Linux wheel is CUDA's

# torch first, pinned: any package asking for a newer torch would otherwise pull another multi-GB build.
"${pip[@]}" ${torch_index[@]+"${torch_index[@]}"} torch==2.13.0
if [ "$gpu" = yes ] && ! .venv/bin/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())"; then
  echo "warning: a GPU is present but torch cannot use it; set QUANTFORGE_TORCH_INDEX to a CUDA build's index" >&2
fi

# llama.cpp compiles on install. Build it for plain AVX2 rather than -march=native: the native build enables
# Intel AMX on CPUs that advertise it, and its AMX matrix kernel segfaults on the VMs we run on (measured).
# --no-cache-dir keeps pip from reusing a wheel built natively elsewhere on this machine.
# With nvcc, llama.cpp is built with CUDA too (then --device cuda offloads every layer to the GPU).
cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
want_cuda=0
if [ "$gpu" = yes ] && command -v nvcc >/dev/null 2>&1; then cmake_args="$cmake_args -DGGML_CUDA=on"; want_cuda=1; fi
llama_ok() { .venv/bin/python -c "import llama_cpp,sys; sys.exit('AMX_INT8 = 1' in llama_cpp.llama_print_system_info().decode() or ($want_cuda and not llama_cpp.llama_supports_gpu_offload()))" 2>/dev/null; }
if ! llama_ok; then
  CMAKE_ARGS="$cmake_args" \
    "${pip[@]}" --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
  "${pip[@]}" llama-cpp-python==0.3.36   # its pure-Python requirements
fi

"${pip[@]}" -e ".[all]"

# llama.cpp's own GGUF converter, from the sdist of the llama-cpp-python just installed, into quantforge's cache:
# GGUF conversion then works offline, with the converter of the very llama.cpp that loads the files. --tools also
# builds llama.cpp's llama-imatrix and llama-quantize from that source (importance-matrix GGUFs; 5 minutes on 2
# cores, once; CMAKE_ARGS as above adds CUDA).
.venv/bin/quantforge setup >/dev/null
CMAKE_ARGS="$cmake_args" .venv/bin/quantforge setup --tools >/dev/null ||
  echo "warning: llama.cpp's tools did not build; imatrix GGUFs need them ('quantforge setup --tools')" >&2

if [ "${1:-}" = "test" ] && ! command -v go >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q golang-go >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q golang-go >/dev/null; }
  else
    echo "install Go (golang-go) for the Modelfile template tests" >&2
  fi
fi
