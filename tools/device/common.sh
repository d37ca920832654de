# Shared by the tools/device/build_*.sh scripts (source it; not a command).

# nvcc through its real path: through the /usr/local/cuda link it cannot find
# its own headers.
NVCC="$(readlink -f /usr/local/cuda/bin/nvcc)"
ARCH="-gencode=arch=compute_90a,code=sm_90a"

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
