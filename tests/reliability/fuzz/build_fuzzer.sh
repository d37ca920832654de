#!/usr/bin/env bash
# Builds the libFuzzer target over request validation, outside Bazel:
# protoc --cpp_out for the API proto, then clang++ -fsanitize=fuzzer,address
# over the fuzzer, server/transport/request_validation.cc (with the
# guarded reads it uses, server/shared_memory/mapped_reads.cc, and the
# error details, proto/status_details.cc) and the
# generated code.
#
# Usage: tests/reliability/fuzz/build_fuzzer.sh [OUT_DIR]   (default build/fuzz)
# Prints the fuzzer's path. Needs clang++ and libFuzzer (Debian 12:
# apt-get install -y clang libclang-rt-14-dev), protoc, libprotobuf-dev, libabsl-dev.
# Rebuilds only when a source is newer than the binary.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../../.." && pwd)
out=$(realpath -m "${1:-$repo/build/fuzz}")
fuzzer="$out/request_validation_fuzzer"
sources=("$repo/tests/reliability/fuzz/request_validation_fuzzer.cc"
         "$repo/server/transport/request_validation.cc"
         "$repo/server/transport/request_validation.h"
         "$repo/server/transport/request_wire.cc"
         "$repo/server/transport/request_wire.h"
         "$repo/proto/wire_format.h"
         "$repo/server/shared_memory/mapped_reads.cc"
         "$repo/server/shared_memory/mapped_reads.h"
         "$repo/proto/status_details.cc" "$repo/proto/status_details.h"
         "$repo/proto/google/rpc/status.proto"
         "$repo/proto/google/rpc/error_details.proto"
         "$repo/kernels/bfloat16.h" "$repo/proto/detlogp/v1/detlogp.proto")

stale=0
[[ -x "$fuzzer" ]] || stale=1
for s in "${sources[@]}"; do [[ "$s" -nt "$fuzzer" ]] && stale=1; done
if ((stale)); then
  command -v clang++ >/dev/null || { echo "clang++ missing: apt-get install -y clang libclang-rt-14-dev" >&2; exit 1; }
  mkdir -p "$out/gen"
  protoc --proto_path="$repo/proto" --cpp_out="$out/gen" "$repo/proto/detlogp/v1/detlogp.proto" \
    "$repo/proto/google/rpc/status.proto" "$repo/proto/google/rpc/error_details.proto"
  # Same system libraries as //third_party:absl and //third_party:protobuf.
  libs=(-lprotobuf -labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info
        -labsl_cord_internal -labsl_cordz_functions -labsl_cordz_handle
        -labsl_crc_cord_state -labsl_crc32c -labsl_crc_internal
        -labsl_str_format_internal -labsl_strings -labsl_strings_internal
        -labsl_int128 -labsl_throw_delegate -labsl_synchronization -labsl_time
        -labsl_time_zone -labsl_base -labsl_raw_logging_internal
        -labsl_log_severity -labsl_spinlock_wait -labsl_stacktrace
        -labsl_symbolize -labsl_debugging_internal -labsl_demangle_internal
        -labsl_malloc_internal -labsl_graphcycles_internal -lpthread)
  available=()
  for l in "${libs[@]}"; do
    name=${l#-l}
    if [[ $name == pthread || $name == protobuf ]] || compgen -G "/usr/lib/*/lib$name.so" >/dev/null; then
      available+=("$l")
    fi
  done
  clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address -fno-omit-frame-pointer \
    -I"$repo" -I"$out/gen" \
    "$repo/tests/reliability/fuzz/request_validation_fuzzer.cc" \
    "$repo/server/transport/request_validation.cc" \
    "$repo/server/transport/request_wire.cc" \
    "$repo/server/shared_memory/mapped_reads.cc" \
    "$repo/proto/status_details.cc" \
    "$out/gen/detlogp/v1/detlogp.pb.cc" \
    "$out/gen/google/rpc/status.pb.cc" "$out/gen/google/rpc/error_details.pb.cc" \
    "${available[@]}" -o "$fuzzer.tmp"
  mv "$fuzzer.tmp" "$fuzzer"
fi
echo "$fuzzer"
