#!/usr/bin/env bash
# Installs the Debian 12 packages kvsparse builds and tests with. Needs root (or sudo).
set -euo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  ca-certificates cmake ninja-build g++ make pkg-config \
  libhwy-dev libpcre2-dev nlohmann-json3-dev libcli11-dev libfmt-dev libcpp-httplib-dev \
  libgtest-dev libgmock-dev libbenchmark-dev \
  python3 python3-matplotlib qemu-user \
  clang lld libclang-rt-14-dev libomp-14-dev >/dev/null  # the sanitizer build, libFuzzer, linking
echo "install-deps: done"
