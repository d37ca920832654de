#!/usr/bin/env bash
# Builds the portable mma.sync linear-logp kernel's gtest binary (issue #13,
# tests/cuda/linear_logp_portable_test.cu, with the launcher
# kernels/cuda/linear_logp_cuda.cu for sm_90a and the portable kernel's own
# object for sm_80/86/89/90 + compute_80 PTX, as Bazel builds them) into
# .device/portable/ (git-ignored) with the shared libraries it loads in
# .device/portable/lib, for tools/device/run_portable.sh on the device
# machine; prints ptxas' register/stack lines for each architecture.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
OUT=.device/portable
mkdir -p "$OUT/lib"
LIBS="$(absl_link_flags)"

LOGP_OBJS="$(linear_logp_objects "$OUT")"
grep -E "for 'sm_|registers|stack" "$OUT/ptxas.log" | grep -v "^ptxas info    : Function properties" || true
"$NVCC" -std=c++17 -O3 $ARCH -I. -Xcompiler -ffp-contract=off -c tests/cuda/linear_logp_portable_test.cu -o "$OUT/linear_logp_portable_test.o"
"$NVCC" $ARCH -o "$OUT/linear_logp_portable_test" "$OUT/linear_logp_portable_test.o" $LOGP_OBJS \
  /usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a $LIBS -lpthread
if sass_check "$OUT/linear_logp_portable.o" "$OUT/sass.txt"; then
  echo "HMMA instructions in SASS (every architecture): $(grep -c HMMA "$OUT/sass.txt" || true)"
fi
bundle_shared_libs "$OUT/lib" "$OUT/linear_logp_portable_test"
ls "$OUT/lib" | tr '\n' ' '; echo
du -sh "$OUT"
