#!/usr/bin/env bash
# Builds the portable mma.sync linear-logp kernel's gtest binary (issue #13,
# tests/cuda/linear_logp_portable_test.cu, with the launcher
# kernels/cuda/linear_logp_cuda.cu for sm_90a) into .device/portable/
# (git-ignored) with the shared libraries it loads in .device/portable/lib,
# for tools/device/run_portable.sh on the device machine. Also compiles the
# kernel alone for sm_80/86/89/90 + compute_80 PTX (the architectures issue
# #13 ships) and prints ptxas' register/stack lines for each.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
OUT=.device/portable
mkdir -p "$OUT/lib"
FLAGS="-std=c++17 -O3 $ARCH -I. -Xcompiler -fPIC -Xcompiler -ffp-contract=off -Xptxas -v"
LIBS="$(absl_link_flags)"

"$NVCC" $FLAGS -c kernels/cuda/linear_logp_cuda.cu -o "$OUT/linear_logp_cuda.o" 2> "$OUT/ptxas.log" || { cat "$OUT/ptxas.log"; exit 1; }
grep -A2 "Portable" "$OUT/ptxas.log" | grep -E "registers|stack" || true
"$NVCC" -std=c++17 -O3 $ARCH -I. -Xcompiler -ffp-contract=off -c tests/cuda/linear_logp_portable_test.cu -o "$OUT/linear_logp_portable_test.o"
"$NVCC" $ARCH -o "$OUT/linear_logp_portable_test" "$OUT/linear_logp_portable_test.o" "$OUT/linear_logp_cuda.o" \
  /usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a $LIBS -lpthread
# The kernel for every shipped architecture (not linked into anything yet).
MULTI="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_86,code=sm_86 -gencode=arch=compute_89,code=sm_89 -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_80,code=compute_80"
"$NVCC" -std=c++17 -O3 $MULTI -I. -Xcompiler -fPIC -Xptxas -v -c kernels/cuda/linear_logp_portable_arch_check.cu \
  -o "$OUT/portable_arch_check.o" 2> "$OUT/ptxas_multi.log" || { cat "$OUT/ptxas_multi.log"; exit 1; }
grep -E "for 'sm_|registers|stack" "$OUT/ptxas_multi.log" | grep -v "^ptxas info    : Function properties" || true
if sass_check "$OUT/linear_logp_cuda.o" "$OUT/sass.txt"; then
  echo "HMMA instructions in SASS (whole launcher object): $(grep -c HMMA "$OUT/sass.txt" || true)"
fi
bundle_shared_libs "$OUT/lib" "$OUT/linear_logp_portable_test"
ls "$OUT/lib" | tr '\n' ' '; echo
du -sh "$OUT"
