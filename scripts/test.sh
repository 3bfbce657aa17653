#!/usr/bin/env bash
# Builds kvsparse and runs every test: the Release suite (kernel tests and end-to-end golden tests
# once per kernel family the CPU runs), a check that only the kernel families use AVX, kernel and
# golden tests on emulated older CPUs (AVX2-only, no AVX), the whole suite again under
# AddressSanitizer + UBSan, and each libFuzzer harness for 45 seconds. Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
# Each phase's wall time, so the CI budget (35 minutes) can be watched: "phase NAME: S s".
phase_start=$SECONDS
phase() { echo "test.sh phase $1: $((SECONDS - phase_start)) s (total $SECONDS s)"; phase_start=$SECONDS; }

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$JOBS"
phase "release build"
./build/kvsparse --version
bash scripts/check-baseline-isa.sh build/libkvsparse_core.a
ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 600
phase "release tests"
# The same binaries on an emulated AVX2-only CPU and a CPU without AVX.
bash scripts/test-older-cpus.sh build
phase "older CPUs"

# Every test again under ASan + UBSan, built with clang (-O1: the sanitizers' own advice, and a
# faster build) and with libFuzzer's coverage in the library, so the same build links the fuzzers.
CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Asan -DKVS_ASAN=ON -DKVS_FUZZ=ON \
  -DKVS_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j "$JOBS"
phase "asan build"
# LLVM's OpenMP runtime keeps per-thread state it never frees: not our leak (fuzz/lsan.supp).
LSAN_OPTIONS="suppressions=$PWD/fuzz/lsan.supp:print_suppressions=0" ASAN_OPTIONS=detect_leaks=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS" --timeout 900
phase "asan tests"
# Each libFuzzer harness for 45 seconds on its seeds (fixed seed: a failure here reproduces), two
# at a time; scripts/fuzz.sh runs them for longer by hand.
FUZZ_BUILD=build-asan FUZZ_JOBS="$JOBS" FUZZ_SEED=1 bash scripts/fuzz.sh "${FUZZ_SECONDS:-45}"
phase "fuzz"
