#!/usr/bin/env bash
# Builds everything a GPU host runs with Bazel (the default CUDA config) and
# bundles it into .device/bundle/ (git-ignored), and the same compressed into
# .device/bundle.tar.gz, for tools/device/run_suite.sh there:
#   bin/       the server, the CLI, the serving benchmarks, the kernels'
#              benchmarks, every gtest tagged "gpu" and the tests that run
#              against a GPU server (live_weights_test)
#   lib/       the ops libraries (libdetlogp_ops.so, libdetlogp_ops_cuda.so),
#              the C++ client's C ABI (libdetlogp_client.so), the kernels' bench library (liblogp_bench.so) and every shared
#              library these load that a GPU host does not bring itself
#   runfiles/  where the server-process tests look for the binaries
#   python/    client/python (pip install python/client, or PYTHONPATH)
#   scripts/   run_suite.sh, the benchmark scripts (tools/device/*.py) and
#              the examples and load generator the suites run
#   tests/device/  the device suites (pytest, a marker a suite)
#   gpu_tests.txt  the gtest binaries tagged "gpu", one a line
#   memcheck.json  {gtest binary: filter} of the memcheck tests
#                  (tests/cuda/memcheck.bzl)
# Usage: tools/device/bundle.sh [BAZEL FLAGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device/bundle

# gtests tagged gpu, found rather than listed: a new one travels without an
# edit here (the memcheck tests, sh_test, wrap two of them).
mapfile -t gpu_tests < <(bazel query --noshow_progress \
  'kind(cc_test, attr(tags, "\bgpu\b", tests(//...)))' 2>/dev/null)
if [[ ${#gpu_tests[@]} -eq 0 ]]; then
  echo "bundle.sh: bazel query found no test tagged gpu" >&2
  exit 1
fi
binaries=(
  //server:detlogp_server
  //client:detlogp_cli
  //tools/bench:serve_throughput
  //tools/bench:swap_under_load
  //tools/bench:projection_stream
  //tools/device:projection_bench
  //tools/device:wgmma_rate_bench
  //tests:live_weights_test
  "${gpu_tests[@]}"
)
libraries=(
  //kernels/capi:libdetlogp_ops.so
  //kernels/capi:libdetlogp_ops_cuda.so
  //client/capi:libdetlogp_client.so
  //tools/device:liblogp_bench.so
)
echo "== bazel build: ${#binaries[@]} binaries, ${#libraries[@]} libraries" >&2
bazel build "$@" "${binaries[@]}" "${libraries[@]}" //tests/cuda:memcheck_json >&2

# //a/b:c -> bazel-bin/a/b/c
output_of() {
  local label=${1#//}
  echo "bazel-bin/${label%%:*}/${label##*:}"
}

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/scripts" "$out/python"
copied=()
for label in "${binaries[@]}"; do
  cp -f "$(output_of "$label")" "$out/bin/"
  copied+=("$(output_of "$label")")
done
for label in "${libraries[@]}"; do
  cp -f "$(output_of "$label")" "$out/lib/"
  copied+=("$(output_of "$label")")
done
chmod -R u+w "$out"

# The shared libraries they load, less those every GPU host has: glibc's,
# the C++ runtime and the driver's (libcuda comes with the driver).
for file in "${copied[@]}"; do
  ldd "$file" | awk '/=> \// { print $3 }'
done | sort -u | while read -r so; do
  case "$(basename "$so")" in
    libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | ld-linux* | \
      libstdc++.so* | libgcc_s.so* | libcuda.so* | libnvidia-*) ;;
    *) cp -fL "$so" "$out/lib/" ;;
  esac
done

# Where ServerProcess (tests/server_process.cc) finds the binaries:
# $TEST_SRCDIR/detlogp/server/detlogp_server and client/detlogp_cli.
mkdir -p "$out/runfiles/detlogp/server" "$out/runfiles/detlogp/client"
ln -s ../../../bin/detlogp_server "$out/runfiles/detlogp/server/detlogp_server"
ln -s ../../../bin/detlogp_cli "$out/runfiles/detlogp/client/detlogp_cli"

# The package's own files only (tracked or new, not ignored): no virtual
# environments or build trees that happen to lie under client/python.
git ls-files -co --exclude-standard client/python | while IFS= read -r f; do
  mkdir -p "$out/python/client/$(dirname "${f#client/python/}")"
  cp "$f" "$out/python/client/${f#client/python/}"
done
cp tools/device/run_suite.sh tools/device/*.py "$out/scripts/"
mkdir -p "$out/tests"
cp -r tests/device "$out/tests/device"
find "$out/tests" -name __pycache__ -prune -exec rm -rf {} +
cp -f bazel-bin/tests/cuda/memcheck.json "$out/memcheck.json"
cp examples/grpo_twin_step.py tests/load/detlogp_load.py tools/bench/fanout_push.py "$out/scripts/"
# The gtests the "tests" suite runs.
for label in "${gpu_tests[@]}"; do echo "${label##*:}"; done > "$out/gpu_tests.txt"
git rev-parse HEAD > "$out/COMMIT" 2>/dev/null || true

# One compressed file to copy to the GPU host; run_suite.sh unpacks it
# there when it is newer than the unpacked bundle.
tar -C "$(dirname "$out")" -czf "$out.tar.gz" "$(basename "$out")"
echo "bundled into $out: $(ls "$out/bin" | wc -l) binaries, $(ls "$out/lib" | wc -l) libraries ($(du -sh "$out" | cut -f1)); $out.tar.gz: $(du -sh "$out.tar.gz" | cut -f1)"
