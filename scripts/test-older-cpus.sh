#!/usr/bin/env bash
# Runs the built binaries on emulated older CPUs (QEMU user mode), whatever CPU this host has:
# Haswell (AVX2 + FMA + F16C, no AVX-512) and plain x86-64 (no AVX). QEMU raises SIGILL for an
# instruction the emulated CPU lacks, as the hardware would, so this shows that the dispatched
# binary picks a family each CPU runs and never strays outside it. Kernel tests for the families
# each CPU runs, the stories260K golden ids, and the CLI. Usage: bash scripts/test-older-cpus.sh [build]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
if ! command -v qemu-x86_64 >/dev/null; then
  echo "test-older-cpus: qemu-x86_64 not installed (apt-get install qemu-user); skipping"
  exit 0
fi
# QEMU warns about CPU-model features its emulator lacks (pcid, rtm, ...): noise, not failures.
emulate() { local cpu=$1; shift; qemu-x86_64 -cpu "$cpu" "$@" 2> >(grep -v "TCG doesn't support requested feature" >&2); }
for cpu in Haswell qemu64; do
  expected=$([ "$cpu" = Haswell ] && echo avx2 || echo scalar)
  version=$(emulate "$cpu" "$BUILD/kvsparse" --version)
  echo "$cpu: $(echo "$version" | tail -1)"
  grep -q "kernels: $expected " <<<"$version" || { echo "test-older-cpus: $cpu should run $expected" >&2; exit 1; }
  for test in vector_ops_test kv_quant_test quantize_test; do
    emulate "$cpu" "$BUILD/$test" --gtest_brief=1
  done
  emulate "$cpu" "$BUILD/stories260k_test" --gtest_brief=1 --gtest_filter='*GreedyContinuationMatchesLlama2c*'
done
echo "test-older-cpus: passed"
