#!/usr/bin/env bash
# Bundles what tools/device/run_backward.sh needs (issue #15) into
# .device/backward/ (git-ignored): the backward's GPU tests and the MN-major
# wgmma micro test as Bazel builds them, the CUDA ops library for the bench
# (tools/device/logp_backward_bench.py), and the shared libraries they load
# in .device/backward/lib. For the Liger-Kernel baseline, also put its wheel
# in .whl/ (`pip download --no-deps -d .whl liger-kernel`) and carry .whl.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
OUT=.device/backward
rm -rf "$OUT"
mkdir -p "$OUT/lib"
bazel build //tests/cuda:wgmma_mn_major_test //tests/cuda:linear_logp_backward_test \
  //kernels/capi:libdetlogp_ops_cuda.so >&2
cp -f bazel-bin/tests/cuda/wgmma_mn_major_test bazel-bin/tests/cuda/linear_logp_backward_test \
  bazel-bin/kernels/capi/libdetlogp_ops_cuda.so "$OUT/"
chmod u+w "$OUT"/*
bundle_shared_libs "$OUT/lib" "$OUT/wgmma_mn_major_test" "$OUT/linear_logp_backward_test" \
  "$OUT/libdetlogp_ops_cuda.so"
du -sh "$OUT"
