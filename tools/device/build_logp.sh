#!/usr/bin/env bash
# Builds the CUDA fused linear-logp library, its gtest binaries (the kernels;
# the top-k screens' device pieces; the top-k floor kernel) and the ctypes
# benchmark library into .device/logp/ (git-ignored), and copies the
# non-system shared libraries they load into .device/logp/lib, so that
# tools/device/run_logp.sh can run them on the device machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
OUT=.device/logp
mkdir -p "$OUT/lib"
FLAGS="-std=c++17 -O3 $ARCH -I. -Xcompiler -fPIC -Xptxas -v"
LIBS="$(absl_link_flags)"

LOGP_OBJS="$(linear_logp_objects "$OUT")"
grep -E "registers|stack|C75" "$OUT/ptxas.log" || true
"$NVCC" -std=c++17 -O3 $ARCH -I. -c tests/cuda/linear_logp_cuda_test.cu -o "$OUT/linear_logp_cuda_test.o"
"$NVCC" $ARCH -o "$OUT/linear_logp_cuda_test" "$OUT/linear_logp_cuda_test.o" $LOGP_OBJS \
  /usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a $LIBS -lpthread
"$NVCC" -std=c++17 -O3 $ARCH -I. -o "$OUT/top_k_screens_test" tests/cuda/top_k_screens_test.cu \
  /usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a -lpthread
"$NVCC" -std=c++17 -O3 $ARCH -I. -o "$OUT/top_k_floor_test" tests/cuda/top_k_floor_test.cu \
  /usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a -lpthread
"$NVCC" $FLAGS -c tools/device/logp_bench_lib.cu -o "$OUT/logp_bench_lib.o" 2>/dev/null
"$NVCC" $ARCH -shared -o "$OUT/liblogp_bench.so" "$OUT/logp_bench_lib.o" $LOGP_OBJS $LIBS
# SASS check; the device image has cuobjdump too, and run_logp.sh repeats it.
if sass_check "$OUT/linear_logp_cuda.o" "$OUT/sass.txt"; then
  echo "HGMMA instructions in SASS: $(grep -c HGMMA "$OUT/sass.txt")"
  echo "local memory ops in SASS: $(grep -cE 'LDL|STL' "$OUT/sass.txt" || true)"
fi
bundle_shared_libs "$OUT/lib" "$OUT/linear_logp_cuda_test" "$OUT/top_k_screens_test" \
  "$OUT/top_k_floor_test" "$OUT/liblogp_bench.so"
ls "$OUT/lib" | tr '\n' ' '; echo
du -sh "$OUT"
