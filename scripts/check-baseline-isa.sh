#!/usr/bin/env bash
# Fails when code outside the kernel families uses AVX instructions, i.e. when the "runs on any
# x86-64 CPU" promise of the dispatched build is broken (a std:: template or a shared inline
# function compiled inside a family region, or a stray -m flag). Family code lives in Highway's
# per-target namespaces N_AVX2 / N_AVX3 (include/kvsparse/isa.h, src/ops/simd_family.h).
# Usage: bash scripts/check-baseline-isa.sh build/libkvsparse_core.a [more objects or binaries]
set -euo pipefail
status=0
for file in "$@"; do
  # VEX/EVEX instructions all have mnemonics starting with 'v' (vmovss, vfmadd231ps, vpdpbusd...).
  offenders=$(objdump -d -C --no-show-raw-insn "$file" | awk '
    /^[0-9a-f]+ <.*>:$/ { fn = $0; next }
    /^ +[0-9a-f]+:\t/ {
      split($0, parts, "\t"); insn = parts[2]
      if (insn ~ /^v[a-z0-9]/ && fn !~ /N_AVX[23]::/ && !(fn in seen)) { seen[fn] = 1; print fn " -> " insn }
    }')
  if [ -n "$offenders" ]; then
    echo "check-baseline-isa: $file has AVX instructions outside the kernel families:" >&2
    echo "$offenders" | head -20 >&2
    status=1
  else
    echo "check-baseline-isa: $file: only kernel families use AVX"
  fi
done
exit $status
