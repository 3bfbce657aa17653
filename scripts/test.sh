#!/usr/bin/env bash
# Builds kvsparse and runs every test: the Release suite, then the bad-input tests
# again under AddressSanitizer + UBSan. Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$JOBS"
ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 600

# Hostile inputs must fail cleanly, never read out of bounds: rerun those tests under ASan/UBSan.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVS_ASAN=ON -DKVS_BUILD_BENCH=OFF >/dev/null
ASAN_TARGETS="kvsparse cli_test gguf_test gguf_hostile_test gguf_writer_test model_test tokenizer_test
  kv_config_test page_pool_test paged_kv_cache_test tasks_user_test bench_runner_test"
# shellcheck disable=SC2086
cmake --build build-asan -j "$JOBS" --target $ASAN_TARGETS
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j "$JOBS" --timeout 900 \
  -R "Hostile|BadInput|Error|Gguf|Tokenizer|Loader|Vocab|KvConfig|PagePool|PagedKvCache|Convert|UserTasks|Corrupt"
