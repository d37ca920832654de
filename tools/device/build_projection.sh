#!/usr/bin/env bash
# Builds the H3 video projection CUDA library, its gtest binaries (CPU and GPU)
# and the benchmark binary into .device/projection/ (git-ignored), and copies
# the non-system shared libraries they load into .device/projection/lib, so
# tools/device/run_projection.sh can run them on the device machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC="$(readlink -f /usr/local/cuda/bin/nvcc)"
OUT=.device/projection
mkdir -p "$OUT/lib"
ARCH="-gencode=arch=compute_90a,code=sm_90a"
# No --use_fast_math: the kernels write fmaf explicitly and nvcc never
# reassociates; the contract's order is checked in SASS below.
FLAGS="-std=c++17 -O3 $ARCH -I. -Xptxas -v"
ABSL="-labsl_status -labsl_statusor -labsl_strings -labsl_str_format_internal \
 -labsl_cord -labsl_cordz_info -labsl_cord_internal -labsl_cordz_functions \
 -labsl_cordz_handle -labsl_crc_cord_state -labsl_raw_logging_internal \
 -labsl_strings_internal -labsl_int128 -labsl_throw_delegate -labsl_base \
 -labsl_spinlock_wait -labsl_synchronization -labsl_time -labsl_stacktrace \
 -labsl_symbolize -labsl_malloc_internal -labsl_debugging_internal \
 -labsl_demangle_internal -labsl_graphcycles_internal -labsl_time_zone \
 -labsl_exponential_biased -labsl_bad_optional_access -labsl_log_severity"
LIBS=""
for l in $ABSL; do  # keep the absl libraries this system has
  n="${l#-l}"
  if ls /usr/lib/x86_64-linux-gnu/lib${n}.so >/dev/null 2>&1; then LIBS="$LIBS $l"; fi
done
GTEST="/usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a"

"$NVCC" $FLAGS -c kernels/cuda/projection_cuda.cu -o "$OUT/projection_cuda.o" 2> "$OUT/ptxas.log" || { cat "$OUT/ptxas.log"; exit 1; }
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
CUOBJDUMP="${CUOBJDUMP:-$(command -v cuobjdump || echo "$(dirname "$NVCC")/cuobjdump")}"
if [ -x "$CUOBJDUMP" ]; then
  "$CUOBJDUMP" --dump-sass "$OUT/projection_cuda.o" > "$OUT/sass.txt" || true
  awk '/Function : /{f=$3} /FFMA|FMUL|FADD|LDL|STL/{for(i=1;i<=NF;i++) if($i ~ /^(FFMA|FMUL|FADD|LDL|STL)/){split($i,a,".");c[f" "a[1]]++;break}} END{for(k in c) print "  SASS", k, c[k]}' "$OUT/sass.txt" | sed 's/_ZN7detlogp7kernels//' | sort
else
  echo "cuobjdump not found here: SASS check left to run_projection.sh"
fi
for bin in "$OUT/projection_test" "$OUT/projection_cuda_test" "$OUT/projection_bench"; do
  ldd "$bin" | awk '/=> \//{print $3}' | while read -r so; do
    case "$(basename "$so")" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|libcuda.so*) ;;
      *) cp -L "$so" "$OUT/lib/" ;;
    esac
  done
done
ls "$OUT/lib" | tr '\n' ' '; echo
du -sh "$OUT"
