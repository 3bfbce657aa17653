#!/usr/bin/env bash
# The README's "files people download" table: kvsparse bench-speed against llama.cpp's llama-bench on
# the same synthesized llama-quantize mixes, 2 threads, alternated, two rounds each.
# Usage: LLAMA_BENCH=/path/to/llama-bench bash scripts/compare-llamacpp.sh [OUT_DIR]
# (llama.cpp is not a dependency: build it yourself, e.g. from its Feb 2025 release.)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_BENCH:?set LLAMA_BENCH to a llama-bench binary}"
out=${1:-/tmp/kvsparse-vs-llamacpp}
mkdir -p "$out"
for spec in "tinyllama-1.1b q8_0" "tinyllama-1.1b q4_k_m" "tinyllama-1.1b q5_k_m" "llama-3.2-1b q4_k_m"; do
  set -- $spec
  file="$out/$1-$2.gguf"
  [ -f "$file" ] || ./build/kvsparse synth --shape "$1" --type "$2" -o "$file" >/dev/null
  for round in 1 2; do
    echo "=== $1 $2 round $round: kvsparse"
    ./build/kvsparse bench-speed -m "$file" -p 512 -n 128 -t 2 -r 3 2>&1 | grep -E '^\| (pp|tg)|bandwidth'
    echo "=== $1 $2 round $round: llama.cpp"
    LD_LIBRARY_PATH="$(dirname "$LLAMA_BENCH")" "$LLAMA_BENCH" -m "$file" -p 512 -n 128 -t 2 -r 3 2>&1 | grep -E 'pp512|tg128'
  done
done
