#!/usr/bin/env bash
# Builds the server, CLI and serving benchmark here (CUDA build) and bundles
# them with the shared libraries they load into .device/serve, for the device
# machine (Ubuntu 24.04 + CUDA 13 there; Debian 12 here).
set -euo pipefail
cd "$(dirname "$0")/../.."
bazel build //server:detlogp_server //client:detlogp_cli //tools/bench:serve_throughput \
  //tests/cuda:linear_logp_cuda_test //tests/cuda:projection_cuda_test >&2
out=.device/serve
rm -rf "$out" && mkdir -p "$out/lib"
for binary in server/detlogp_server client/detlogp_cli tools/bench/serve_throughput \
    tests/cuda/linear_logp_cuda_test tests/cuda/projection_cuda_test; do
  cp -f "bazel-bin/$binary" "$out/"
  ldd "bazel-bin/$binary" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$lib" in
      # The device's own libc, libstdc++, cudart and driver are used there.
      */libc.so*|*/libm.so*|*/libpthread.so*|*/libdl.so*|*/librt.so*|*/ld-linux*|*/libgcc_s.so*|*/libcuda.so*|*/libstdc++.so*) ;;
      *) cp -fL "$lib" "$out/lib/" ;;
    esac
  done
done
cp tools/device/run_serve.sh "$out/"
du -sh "$out" >&2
