#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build, serve and test
# detlogp. Idempotent: installs only missing packages.
set -euo pipefail

packages=(
  bazel-bootstrap g++ libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev
  protobuf-compiler libabsl-dev libspdlog-dev libfmt-dev libgtest-dev
  libgmock-dev libbenchmark-dev libssl-dev libzstd-dev prometheus-cpp-dev python3 python3-venv
  openssl pkg-config
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}" >&2
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
