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

# The CPU build of torch first: any package asking for a newer torch would otherwise pull a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0

# llama.cpp compiles on install. Build it for plain AVX2 rather than -march=native: the native build enables
# Intel AMX on CPUs that advertise it, and its AMX matrix kernel segfaults on the VMs we run on (measured).
# --no-cache-dir keeps pip from reusing a wheel built natively elsewhere on this machine.
llama_ok() { .venv/bin/python -c "import llama_cpp,sys; sys.exit('AMX_INT8 = 1' in llama_cpp.llama_print_system_info().decode())" 2>/dev/null; }
if ! llama_ok; then
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
    "${pip[@]}" --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
  "${pip[@]}" llama-cpp-python==0.3.36   # its pure-Python requirements
fi

"${pip[@]}" -e ".[all]"

# llama.cpp's own GGUF converter, from the sdist of the llama-cpp-python just installed, into quantforge's cache:
# GGUF conversion then works offline, with the converter of the very llama.cpp that loads the files.
.venv/bin/quantforge setup >/dev/null

if [ "${1:-}" = "test" ] && ! command -v go >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q golang-go >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q golang-go >/dev/null; }
  else
    echo "install Go (golang-go) for the Modelfile template tests" >&2
  fi
fi
