#!/usr/bin/env bash
# Builds the server, CLI and serving benchmark here (CUDA build) and bundles
# them with the shared libraries they load into .device/serve, for the device
# machine (Ubuntu 24.04 + CUDA 13 there; Debian 12 here).
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
bazel build //server:detlogp_server //client:detlogp_cli //tools/bench:serve_throughput \
  //tools/bench:swap_under_load //tools/bench:projection_stream //tests:live_weights_test \
  //tests/cuda:linear_logp_cuda_test //tests/cuda:linear_logp_portable_test \
  //tests/cuda:projection_cuda_test //tests/cuda:projection_backend_cuda_test >&2
out=.device/serve
rm -rf "$out" && mkdir -p "$out/lib"
binaries=()
for binary in server/detlogp_server client/detlogp_cli tools/bench/serve_throughput \
    tools/bench/swap_under_load tools/bench/projection_stream tests/live_weights_test \
    tests/cuda/linear_logp_cuda_test tests/cuda/linear_logp_portable_test \
    tests/cuda/projection_cuda_test tests/cuda/projection_backend_cuda_test; do
  cp -f "bazel-bin/$binary" "$out/"
  binaries+=("bazel-bin/$binary")
done
bundle_shared_libs "$out/lib" "${binaries[@]}"
# Where the integration tests look for the server (TEST_SRCDIR=$out/runfiles).
mkdir -p "$out/runfiles/detlogp/server" "$out/runfiles/detlogp/client"
ln -s ../../../detlogp_server "$out/runfiles/detlogp/server/"
ln -s ../../../detlogp_cli "$out/runfiles/detlogp/client/"
cp tools/device/run_serve.sh tools/device/run_live_weights.sh "$out/"
du -sh "$out" >&2
