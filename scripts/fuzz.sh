#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/*_fuzz.cc) with clang under ASan + UBSan in build-fuzz/
# and runs each for SECONDS (default 60), one after another, on a working corpus seeded from
# fuzz/corpus/NAME/, the test data in ../shared (tokenizer inputs) and a written model (GGUF).
# New crashes land in fuzz/regressions/NAME/ (commit them: tests/fuzz_corpus_test.cc replays
# them in every build). Needs clang and libclang-rt-dev (scripts/install-deps.sh installs them).
#   bash scripts/fuzz.sh [SECONDS] [NAME...]      e.g. bash scripts/fuzz.sh 3600 tokenizer gguf
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
shift || true
ALL=(gguf tokenizer kv_config kv_param user_tasks openai_request chat_template http_server)
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=("${ALL[@]}")
JOBS=${JOBS:-$(nproc)}
WORK=${FUZZ_WORK:-build-fuzz/work}

CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Asan -DKVS_ASAN=ON -DKVS_FUZZ=ON \
  -DKVS_BUILD_TESTS=OFF -DKVS_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz -j "$JOBS" --target kvsparse $(printf '%s_fuzz ' "${NAMES[@]}")

# LLVM's OpenMP runtime keeps thread state it never frees: not our leak.
export LSAN_OPTIONS="suppressions=$PWD/fuzz/lsan.supp:print_suppressions=0"
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1"
export OMP_NUM_THREADS=1
SHARED=$(cd .. && pwd)/shared
status=0
for name in "${NAMES[@]}"; do
  corpus="$WORK/$name"
  mkdir -p "$corpus" "fuzz/regressions/$name" "$WORK/crashes-$name"
  [ -d "fuzz/corpus/$name" ] && cp -n fuzz/corpus/"$name"/* "$corpus"/ 2>/dev/null || true
  case "$name" in
    gguf)
      [ -f "$corpus/tiny-llama-q8_0.gguf" ] ||
        ./build-fuzz/kvsparse synth --shape tiny-llama --type q8_0 --layers 1 -o "$corpus/tiny-llama-q8_0.gguf" >/dev/null
      [ -f "$corpus/tiny-qwen2-f16.gguf" ] ||
        ./build-fuzz/kvsparse synth --shape tiny-qwen2 --type f16 --layers 1 -o "$corpus/tiny-qwen2-f16.gguf" >/dev/null ;;
    tokenizer)
      # Each .inp test vector as a seed (selector byte 0x10 + i, no flags).
      if [ -d "$SHARED/vocab" ]; then
        i=0
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
  echo "fuzz: $name for ${SECONDS_EACH} s"
  # -timeout: one input may take 25 s (the server harness waits up to 10 s per exchange).
  if ! KVS_SHARED_DIR="$SHARED" ./build-fuzz/"${name}_fuzz" "$corpus" -dict="fuzz/dict/$name.dict" \
      -max_total_time="$SECONDS_EACH" -timeout=25 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="$WORK/crashes-$name/" >"$WORK/$name.log" 2>&1; then
    status=1
    echo "fuzz: $name FOUND A CRASH (log $WORK/$name.log):"
    grep -E "ERROR|runtime error|invariant violated|Test unit written" "$WORK/$name.log" | head -5
    cp "$WORK"/crashes-"$name"/* "fuzz/regressions/$name/" 2>/dev/null || true
  fi
  grep -E "stat::number_of_executed_units|stat::new_units_added" "$WORK/$name.log" | tr '\n' ' '
  echo
done
exit $status
