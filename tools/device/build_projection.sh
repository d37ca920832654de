#!/usr/bin/env bash
# Builds the H3 video projection CUDA library, its gtest binaries (CPU and GPU)
# and the benchmark binary into .device/projection/ (git-ignored), and copies
# the non-system shared libraries they load into .device/projection/lib, so
# tools/device/run_projection.sh can run them on the device machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
OUT=.device/projection
mkdir -p "$OUT/lib"
# No --use_fast_math: the kernels write fmaf explicitly and nvcc never
# reassociates; the contract's order is checked in SASS below.
FLAGS="-std=c++17 -O3 $ARCH -I. -Xptxas -v"
LIBS="$(absl_link_flags)"
GTEST="/usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a"

"$NVCC" ${FLAGS/$ARCH/$PORTABLE_ARCH} -c kernels/cuda/projection_cuda.cu -o "$OUT/projection_cuda.o" 2> "$OUT/ptxas.log" || { cat "$OUT/ptxas.log"; exit 1; }
grep -E "Compiling|registers|spill" "$OUT/ptxas.log" | sed 's/_ZN7detlogp7kernels//' || true
g++ -std=c++17 -O2 -I. -c kernels/projection.cc -o "$OUT/projection.o"
g++ -std=c++17 -O2 -I. -c kernels/projection_grad.cc -o "$OUT/projection_grad.o"
g++ -std=c++17 -O2 -I. -c kernels/parallel_for.cc -o "$OUT/parallel_for.o"
CPU_OBJS="$OUT/projection.o $OUT/projection_grad.o $OUT/parallel_for.o"
# CPU test (plain g++; also what the lead's Bazel target builds).
g++ -std=c++17 -O2 -I. tests/projection_test.cc $CPU_OBJS -o "$OUT/projection_test" \
  $GTEST $LIBS -pthread
"$NVCC" -std=c++17 -O3 $ARCH -I. -c tests/cuda/projection_cuda_test.cu -o "$OUT/projection_cuda_test.o"
"$NVCC" $ARCH -o "$OUT/projection_cuda_test" "$OUT/projection_cuda_test.o" "$OUT/projection_cuda.o" \
  $CPU_OBJS $GTEST $LIBS -lpthread
"$NVCC" -std=c++17 -O3 $ARCH -I. -c tools/device/projection_bench_main.cu -o "$OUT/projection_bench_main.o"
"$NVCC" $ARCH -o "$OUT/projection_bench" "$OUT/projection_bench_main.o" "$OUT/projection_cuda.o" \
  $CPU_OBJS $LIBS -lpthread
# SASS check: the forward and dX loops must be FFMA chains (no FMUL/FADD
# splitting the fma, no local memory in the hot kernels).
if sass_check "$OUT/projection_cuda.o" "$OUT/sass.txt"; then
  awk '/Function : /{f=$3} /FFMA|FMUL|FADD|LDL|STL/{for(i=1;i<=NF;i++) if($i ~ /^(FFMA|FMUL|FADD|LDL|STL)/){split($i,a,".");c[f" "a[1]]++;break}} END{for(k in c) print "  SASS", k, c[k]}' "$OUT/sass.txt" | sed 's/_ZN7detlogp7kernels//' | sort
fi
bundle_shared_libs "$OUT/lib" "$OUT/projection_test" "$OUT/projection_cuda_test" "$OUT/projection_bench"
ls "$OUT/lib" | tr '\n' ' '; echo
du -sh "$OUT"
