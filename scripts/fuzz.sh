#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/*_fuzz.cc) with clang under ASan + UBSan in build-fuzz/
# and runs each for SECONDS (default 60) on a working corpus seeded from fuzz/corpus/NAME/, the
# test data in ../shared (tokenizer inputs) and a written model (GGUF).
# New crashes land in fuzz/regressions/NAME/ (commit them: tests/fuzz_corpus_test.cc replays
# them in every build). Needs clang and libclang-rt-dev (scripts/install-deps.sh installs them).
#   bash scripts/fuzz.sh [SECONDS] [NAME...]      e.g. bash scripts/fuzz.sh 3600 tokenizer gguf
# Environment:
#   FUZZ_JOBS=N    harnesses run N at a time (default 1)
#   FUZZ_SEED=N    libFuzzer's random seed (default 0: a new one each run; CI fixes it)
#   FUZZ_BUILD=DIR an existing clang build with -DKVS_ASAN=ON -DKVS_FUZZ=ON (scripts/test.sh's
#                  build-asan) instead of configuring build-fuzz/
#   FUZZ_WORK=DIR  the working corpora and logs (default BUILD/fuzz-work)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
shift || true
ALL=(gguf tokenizer kv_config kv_param user_tasks openai_request chat_template http_server)
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=("${ALL[@]}")
JOBS=${JOBS:-$(nproc)}
FUZZ_JOBS=${FUZZ_JOBS:-1}
FUZZ_SEED=${FUZZ_SEED:-0}
BUILD=${FUZZ_BUILD:-build-fuzz}
WORK=${FUZZ_WORK:-$BUILD/fuzz-work}

if [ -z "${FUZZ_BUILD:-}" ]; then
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Asan -DKVS_ASAN=ON -DKVS_FUZZ=ON \
    -DKVS_BUILD_TESTS=OFF -DKVS_BUILD_BENCH=OFF >/dev/null
fi
cmake --build "$BUILD" -j "$JOBS" --target kvsparse $(printf '%s_fuzz ' "${NAMES[@]}")

# LLVM's OpenMP runtime keeps thread state it never frees: not our leak.
export LSAN_OPTIONS="suppressions=$PWD/fuzz/lsan.supp:print_suppressions=0"
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1"
export OMP_NUM_THREADS=1
SHARED=$(cd .. && pwd)/shared
# Seeds NAME's working corpus, runs it, and leaves "ok" or "crash" in $WORK/NAME.result.
run_one() {
  local name=$1
  local corpus="$WORK/$name"
  mkdir -p "$corpus" "fuzz/regressions/$name" "$WORK/crashes-$name"
  [ -d "fuzz/corpus/$name" ] && cp -n fuzz/corpus/"$name"/* "$corpus"/ 2>/dev/null || true
  case "$name" in
    gguf)
      [ -f "$corpus/tiny-llama-q8_0.gguf" ] ||
        "$BUILD"/kvsparse synth --shape tiny-llama --type q8_0 --layers 1 -o "$corpus/tiny-llama-q8_0.gguf" >/dev/null
      [ -f "$corpus/tiny-qwen2-f16.gguf" ] ||
        "$BUILD"/kvsparse synth --shape tiny-qwen2 --type f16 --layers 1 -o "$corpus/tiny-qwen2-f16.gguf" >/dev/null
      # A mixture of experts with a shared expert: expert keys and 3-D expert tensors to mutate.
      [ -f "$corpus/tiny-qwen2moe-q8_0.gguf" ] ||
        "$BUILD"/kvsparse synth --shape tiny-qwen2moe --type q8_0 --layers 1 -o "$corpus/tiny-qwen2moe-q8_0.gguf" >/dev/null
      # Latent attention (MLA with q_lora) and sigmoid routing with its selection bias.
      [ -f "$corpus/tiny-deepseek3-q8_0.gguf" ] ||
        "$BUILD"/kvsparse synth --shape tiny-deepseek3 --type q8_0 --layers 1 -o "$corpus/tiny-deepseek3-q8_0.gguf" >/dev/null
      # gpt-oss: sinks, biases, per-expert bias tables, MXFP4 expert blocks (type 39).
      [ -f "$corpus/tiny-gpt-oss-mxfp4_moe.gguf" ] ||
        "$BUILD"/kvsparse synth --shape tiny-gpt-oss --type mxfp4_moe --layers 1 -o "$corpus/tiny-gpt-oss-mxfp4_moe.gguf" >/dev/null ;;
    tokenizer)
      # Each .inp test vector as a seed (selector byte 0x10 + i, no flags).
      if [ -d "$SHARED/vocab" ]; then
        local i=0
        for inp in "$SHARED"/vocab/*.inp; do
          python3 - "$inp" "$corpus" "$i" <<'PY'
import sys
path, out, i = sys.argv[1], sys.argv[2], int(sys.argv[3])
for k, text in enumerate(open(path, encoding='utf-8').read().split('\n__ggml_vocab_test__\n')):
    if text:
        open(f'{out}/vector-{i}-{k}', 'wb').write(bytes([0x10 + i, 0]) + text.encode())
PY
          i=$((i + 1))
        done
      fi ;;
  esac
  # -timeout: one input may take 25 s (the server harness waits up to 10 s per exchange).
  if KVS_SHARED_DIR="$SHARED" "$BUILD"/"${name}_fuzz" "$corpus" -dict="fuzz/dict/$name.dict" -seed="$FUZZ_SEED" \
      -max_total_time="$SECONDS_EACH" -timeout=25 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="$WORK/crashes-$name/" >"$WORK/$name.log" 2>&1; then
    echo ok >"$WORK/$name.result"
  else
    echo crash >"$WORK/$name.result"
    cp "$WORK"/crashes-"$name"/* "fuzz/regressions/$name/" 2>/dev/null || true
  fi
}

mkdir -p "$WORK"
echo "fuzz: ${NAMES[*]} for ${SECONDS_EACH} s each, ${FUZZ_JOBS} at a time (seed $FUZZ_SEED)"
running=0
for name in "${NAMES[@]}"; do
  rm -f "$WORK/$name.result"
  if [ "$running" -ge "$FUZZ_JOBS" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_one "$name" &
  running=$((running + 1))
done
wait || true

status=0
for name in "${NAMES[@]}"; do
  stats=$(grep -E "stat::number_of_executed_units|stat::new_units_added" "$WORK/$name.log" 2>/dev/null |
    sed -E 's/stat::(number_of_executed_units|new_units_added): +/\1=/' | tr '\n' ' ')
  if [ "$(cat "$WORK/$name.result" 2>/dev/null)" = ok ]; then
    echo "fuzz: $name ok: $stats"
  else
    status=1
    echo "fuzz: $name FOUND A CRASH (log $WORK/$name.log; input copied to fuzz/regressions/$name/):"
    grep -E "ERROR|runtime error|invariant violated|Test unit written" "$WORK/$name.log" | head -5 || true
  fi
done
exit $status
