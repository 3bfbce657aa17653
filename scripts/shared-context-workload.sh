#!/usr/bin/env bash
# Issue 29's workload: one 8K-token document x 16 questions (question 1 alone, then 4 at a time)
# on the random-weight TinyLlama-1.1B shape (Q8_0), 2 threads, through `kvsparse serve`:
#   cold       every prompt computed whole (--prefix-cache 0 --no-share-prefixes)
#   dense      automatic prefix caching (the default)
#   snapkv     compressed context: SnapKV 20%, int8, prompt-end eviction, question after
#   h2o        compressed context: H2O 20%, int8, prompt-end eviction, question after
# and, with LLAMA_SERVER=/path/to/llama-server, llama.cpp's server with cache_prompt (4 slots).
# One JSON line per configuration (scripts/shared-context-workload.py), into OUT_DIR/results.jsonl.
# Usage: [LLAMA_SERVER=...] [DOC=8192] [QUESTIONS=16] [CONFIGS="cold dense snapkv h2o llama"] \
#        bash scripts/shared-context-workload.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/kvsparse-shared-context}
doc=${DOC:-8192}
questions=${QUESTIONS:-16}
configs=" ${CONFIGS:-cold dense snapkv h2o llama} "
ctx=$((doc + 256))
port=8093
mkdir -p "$out"
model="$out/tinyllama-1.1b-q8_0.gguf"
[ -f "$model" ] || ./build/kvsparse synth --shape tinyllama-1.1b --type q8_0 -o "$model" >/dev/null
for method in snapkv h2o; do
  echo "{\"default\": {\"method\": \"$method\", \"budget\": 0.2, \"kv_type\": \"int8\"}, \"prefill_eviction\": \"prompt_end\"}" \
    > "$out/$method.json"
done

wait_up() {
  for _ in $(seq 1 600); do curl -sf "localhost:$port/health" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "server did not start" >&2
  return 1
}
run() {  # label, client flags, server command...
  local label=$1 client=$2
  shift 2
  "$@" > "$out/$label.log" 2>&1 &
  local pid=$!
  wait_up
  python3 scripts/shared-context-workload.py --base "http://127.0.0.1:$port" --doc "$doc" --questions "$questions" \
    --label "$label" $client | tee -a "$out/results.jsonl"
  kill "$pid"
  wait "$pid" || true
}
serve=(./build/kvsparse serve -m "$model" --port "$port" -c "$ctx" --parallel 4 -t 2)
want() { [[ "$configs" == *" $1 "* ]]; }
if want cold; then run cold "" "${serve[@]}" --prefix-cache 0 --no-share-prefixes; fi
if want dense; then run dense "" "${serve[@]}"; fi
if want snapkv; then run snapkv-int8-20 --context "${serve[@]}" --kv-config "$out/snapkv.json"; fi
if want h2o; then run h2o-int8-20 --context "${serve[@]}" --kv-config "$out/h2o.json"; fi
if want llama && [ -n "${LLAMA_SERVER:-}" ]; then
  run llama-server "--api llama" "$LLAMA_SERVER" -m "$model" --port "$port" -c $((4 * ctx)) -np 4 -t 2 -b 2048 -ub 512
  grep -E "KV self size|kv_cache|KV buffer size" "$out/llama-server.log" | head -3 || true
fi
