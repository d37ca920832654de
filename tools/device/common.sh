# Shared by the tools/device/build_*.sh scripts (source it; not a command).

# nvcc through its real path: through the /usr/local/cuda link it cannot find
# its own headers.
NVCC="$(readlink -f /usr/local/cuda/bin/nvcc)"
ARCH="-gencode=arch=compute_90a,code=sm_90a"
# The portable linear-logp kernel and the H3 projection: every GPU from Ampere
# on (third_party/cuda/cuda.bzl's PORTABLE_GENCODE).
PORTABLE_ARCH="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_86,code=sm_86 -gencode=arch=compute_89,code=sm_89 -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_80,code=compute_80"

# Compiles LinearLogpCuda's three objects into DIR as Bazel does: the launcher
# and Hopper kernel (sm_90a), the portable kernel (PORTABLE_ARCH) and the
# plain C++ kernel choice; ptxas' report goes to DIR/ptxas.log. Prints the
# objects to link.
linear_logp_objects() {
  local dir=$1
  local flags="-std=c++17 -O3 -I. -Xcompiler -fPIC -Xcompiler -ffp-contract=off -Xptxas -v"
  "$NVCC" $flags $ARCH -c kernels/cuda/linear_logp_cuda.cu -o "$dir/linear_logp_cuda.o" 2> "$dir/ptxas.log" || { cat "$dir/ptxas.log" >&2; return 1; }
  "$NVCC" $flags $PORTABLE_ARCH -c kernels/cuda/linear_logp_portable.cu -o "$dir/linear_logp_portable.o" 2>> "$dir/ptxas.log" || { cat "$dir/ptxas.log" >&2; return 1; }
  g++ -std=c++17 -O2 -fPIC -ffp-contract=off -I. -c kernels/cuda/kernel_kind.cc -o "$dir/kernel_kind.o"
  echo "$dir/linear_logp_cuda.o $dir/linear_logp_portable.o $dir/kernel_kind.o"
}

# -l flags for the abseil libraries the kernels' host code needs, keeping
# only those this system has (Debian's split differs between versions).
absl_link_flags() {
  local wanted="status statusor strings str_format_internal cord cordz_info
    cord_internal cordz_functions cordz_handle crc_cord_state
    raw_logging_internal strings_internal int128 throw_delegate base
    spinlock_wait synchronization time stacktrace symbolize malloc_internal
    debugging_internal demangle_internal graphcycles_internal
    kernel_timeout_internal time_zone exponential_biased crc32c crc_internal
    crc_cpu_detect bad_optional_access log_severity"
  local n flags=""
  for n in $wanted; do
    if [ -e "/usr/lib/x86_64-linux-gnu/libabsl_${n}.so" ]; then
      flags="$flags -labsl_${n}"
    fi
  done
  echo "$flags"
}

# Copies the shared libraries that the given binaries load into DIR, except
# those the device machine brings itself (glibc, libstdc++, libgcc, driver).
bundle_shared_libs() {
  local dir=$1 bin so
  shift
  mkdir -p "$dir"
  for bin in "$@"; do
    ldd "$bin" | awk '/=> \//{print $3}' | while read -r so; do
      case "$(basename "$so")" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|libcuda.so*) ;;
        *) cp -fL "$so" "$dir/" ;;
      esac
    done
  done
}

# Disassembles OBJECT into OUT with cuobjdump; says so and fails when this
# machine has no cuobjdump (the device machine has one).
sass_check() {
  local object=$1 out=$2
  local cuobjdump="${CUOBJDUMP:-$(command -v cuobjdump || echo "$(dirname "$NVCC")/cuobjdump")}"
  if [ -x "$cuobjdump" ]; then
    "$cuobjdump" --dump-sass "$object" > "$out" || true
    return 0
  fi
  echo "cuobjdump not found here: SASS check left to the device run"
  return 1
}
