#!/usr/bin/env bash
# README command 1 on a fresh clone, timed (issue 39's goal: at most 10 minutes on 2 cores, the build included).
#   scripts/time_install.sh [SCRATCH]     clones this checkout's HEAD into SCRATCH (default: a new temporary folder)
# Prints the install's and the build's minutes; nothing else should run on the machine meanwhile.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
scratch="${1:-$(mktemp -d)}"
git clone --quiet "$repo" "$scratch/quantforge"
cd "$scratch/quantforge"
started=$SECONDS
./scripts/install.sh
installed=$SECONDS
.venv/bin/quantforge build smollm2-135m --formats gguf-q8_0,gguf-q5km,gguf-q4km >/dev/null
built=$SECONDS
printf 'install %.1f min, build %.1f min, README command 1 %.1f min (goal: 10)\n' \
  "$(echo "($installed - $started) / 60" | bc -l)" "$(echo "($built - $installed) / 60" | bc -l)" \
  "$(echo "($built - $started) / 60" | bc -l)"
