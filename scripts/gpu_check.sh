#!/usr/bin/env bash
# For whoever has an NVIDIA GPU: build the bundled SmolLM2's formats on CUDA and compare every card figure with the
# same build on the CPU (scripts/compare_cards.py). Under 8 minutes on one H200 (16 cores); the CPU half alone runs
# anywhere (about 10 minutes on 2 cores) and is what runs when torch sees no GPU.
#   ./scripts/gpu_check.sh [OUT]          OUT defaults to runs/gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu-check}"
py=.venv/bin/python
# Small on purpose: 8 windows, 32 calibration sequences; GPTQ (GPTQModel) and INT8 (llm-compressor) for the torch
# quantizers, two GGUF types for llama.cpp; group size auto because SmolLM2's 576-wide layers reject 128.
args=(smollm2-135m --formats gguf-q8_0,gguf-q4km,gptq-int4,int8 --group-size auto --ppl-windows 8
      --calib-samples 32 --calib-seqlen 256 --no-speed)

echo "== CPU half" >&2
time .venv/bin/quantforge build "${args[@]}" --device cpu --out "$out/cpu" >/dev/null || [ $? -eq 3 ]

if ! "$py" -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "no CUDA device visible to torch: ran the CPU half only ($out/cpu/card.md)" >&2
  exit 0
fi
echo "== CUDA half ($("$py" -c 'import torch; print(torch.cuda.get_device_name(0))'))" >&2
"$py" -c "import llama_cpp; print('llama.cpp GPU offload:', llama_cpp.llama_supports_gpu_offload())" >&2
time .venv/bin/quantforge build "${args[@]}" --device cuda --out "$out/cuda" >/dev/null || [ $? -eq 3 ]
"$py" scripts/compare_cards.py "$out/cpu/card.json" "$out/cuda/card.json"
# The plan's GPU memory per stage against what the device held while it ran (memory.GpuWatch, sampled).
"$py" - "$out/cuda/run.json" <<'PY'
import json, sys
from quantforge.resources import plan_versus_actual
run = json.load(open(sys.argv[1]))
print(f"{'stage':28} {'planned GB':>10} {'GPU GB':>8} {'ratio':>6}")
for row in plan_versus_actual(run["resource_plan"], run["stages"]):
    if "vram_bytes" in row:
        print(f"{row['key']:28} {row['predicted_vram_bytes'] / 1e9:10.2f} {row['vram_bytes'] / 1e9:8.2f} "
              f"{row['vram_ratio']!s:>6}")
PY
