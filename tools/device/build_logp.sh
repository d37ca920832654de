#!/usr/bin/env bash
# Builds the CUDA fused linear-logp library, its gtest binary and the ctypes
# benchmark library into .device/logp/ (git-ignored), and copies the
# non-system shared libraries they load into .device/logp/lib, so that
# tools/device/run_logp.sh can run them on the device machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC="$(readlink -f /usr/local/cuda/bin/nvcc)"
OUT=.device/logp
mkdir -p "$OUT/lib"
ARCH="-gencode=arch=compute_90a,code=sm_90a"
FLAGS="-std=c++17 -O3 $ARCH -I. -Xcompiler -fPIC -Xptxas -v"
ABSL="-labsl_status -labsl_statusor -labsl_strings -labsl_str_format_internal \
 -labsl_cord -labsl_cordz_info -labsl_cord_internal -labsl_cordz_functions \
 -labsl_cordz_handle -labsl_crc_cord_state -labsl_raw_logging_internal \
 -labsl_strings_internal -labsl_int128 -labsl_throw_delegate -labsl_base \
 -labsl_spinlock_wait -labsl_synchronization -labsl_time -labsl_stacktrace \
 -labsl_symbolize -labsl_malloc_internal -labsl_debugging_internal \
 -labsl_demangle_internal -labsl_graphcycles_internal -labsl_kernel_timeout_internal \
 -labsl_time_zone -labsl_exponential_biased -labsl_crc32c -labsl_crc_internal \
 -labsl_crc_cpu_detect -labsl_bad_optional_access -labsl_log_severity"
# Keep only the absl libraries this system has.
LIBS=""
for l in $ABSL; do
  n="${l#-l}"
  if ls /usr/lib/x86_64-linux-gnu/lib${n}.so >/dev/null 2>&1; then LIBS="$LIBS $l"; fi
done

"$NVCC" $FLAGS -c kernels/cuda/linear_logp_cuda.cu -o "$OUT/linear_logp_cuda.o" 2> "$OUT/ptxas.log" || { cat "$OUT/ptxas.log"; exit 1; }
grep -E "registers|stack|C75" "$OUT/ptxas.log" || true
"$NVCC" -std=c++17 -O3 $ARCH -I. -c tests/cuda/linear_logp_cuda_test.cu -o "$OUT/linear_logp_cuda_test.o"
"$NVCC" $ARCH -o "$OUT/linear_logp_cuda_test" "$OUT/linear_logp_cuda_test.o" "$OUT/linear_logp_cuda.o" \
  /usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a $LIBS -lpthread
"$NVCC" $FLAGS -c tools/device/logp_bench_lib.cu -o "$OUT/logp_bench_lib.o" 2>/dev/null
"$NVCC" $ARCH -shared -o "$OUT/liblogp_bench.so" "$OUT/logp_bench_lib.o" "$OUT/linear_logp_cuda.o" $LIBS
# SASS check (cuobjdump: next to nvcc, on PATH, or CUOBJDUMP=...); the device
# image has one too, and run_logp.sh repeats the check there.
CUOBJDUMP="${CUOBJDUMP:-$(command -v cuobjdump || echo "$(dirname "$NVCC")/cuobjdump")}"
if [ -x "$CUOBJDUMP" ]; then
  "$CUOBJDUMP" --dump-sass "$OUT/linear_logp_cuda.o" > "$OUT/sass.txt"
  echo "HGMMA instructions in SASS: $(grep -c HGMMA "$OUT/sass.txt")"
  echo "local memory ops in SASS: $(grep -cE 'LDL|STL' "$OUT/sass.txt" || true)"
else
  echo "cuobjdump not found here: SASS check left to run_logp.sh"
fi
# Copy non-system shared libraries (everything but glibc/libstdc++/libgcc and
# the driver) that the binaries load.
for bin in "$OUT/linear_logp_cuda_test" "$OUT/liblogp_bench.so"; do
  ldd "$bin" | awk '/=> \//{print $3}' | while read -r so; do
    case "$(basename "$so")" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|libcuda.so*) ;;
      *) cp -L "$so" "$OUT/lib/" ;;
    esac
  done
done
ls "$OUT/lib" | tr '\n' ' '; echo
du -sh "$OUT"
