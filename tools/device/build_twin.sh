#!/usr/bin/env bash
# Builds what tools/device/run_twin.sh needs here (CUDA build) and bundles it
# into .device/twin (git-ignored) for the device machine: the server, the two
# ops libraries (CPU and CUDA C ABIs), the C ABI's CUDA-graph capture test
# and the shared libraries they load.
# The Python package travels as source (client/python); grpcio/protobuf
# wheels for the device's python3, if needed, in .whl (see run_live_weights.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
bazel build //server:detlogp_server //kernels/capi:libdetlogp_ops.so \
  //kernels/capi:libdetlogp_ops_cuda.so \
  //kernels/capi:detlogp_ops_cuda_capture_test >&2
out=.device/twin
rm -rf "$out" && mkdir -p "$out/lib"
binaries=()
for binary in server/detlogp_server kernels/capi/libdetlogp_ops.so \
    kernels/capi/libdetlogp_ops_cuda.so \
    kernels/capi/detlogp_ops_cuda_capture_test; do
  cp -f "bazel-bin/$binary" "$out/"
  binaries+=("bazel-bin/$binary")
done
bundle_shared_libs "$out/lib" "${binaries[@]}"
du -sh "$out" >&2
