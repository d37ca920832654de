#!/usr/bin/env bash
# Bundles the linear-logp backward's GPU tests (issue #15) and the MN-major
# wgmma micro test, as Bazel builds them, into .device/backward/
# (git-ignored) with the shared libraries they load in .device/backward/lib,
# for tools/device/run_backward.sh on the device machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
OUT=.device/backward
rm -rf "$OUT"
mkdir -p "$OUT/lib"
bazel build //tests/cuda:wgmma_mn_major_test //tests/cuda:linear_logp_backward_test >&2
cp -f bazel-bin/tests/cuda/wgmma_mn_major_test bazel-bin/tests/cuda/linear_logp_backward_test "$OUT/"
chmod u+w "$OUT"/*_test
bundle_shared_libs "$OUT/lib" "$OUT/wgmma_mn_major_test" "$OUT/linear_logp_backward_test"
du -sh "$OUT"
