#!/usr/bin/env bash
# Runs every test that runs without a GPU: the C++ tests through Bazel, then
# the Python tests against the real server. Installs what is missing first.
# Ends with one line: "N passed, N failed" (test cases, not targets).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh || { echo "0 passed, 1 failed"; exit 1; }

results_dir=$(mktemp -d)
config=$(tools/bazel_config.sh)
echo "== bazel test //... ${config:-(cuda build; GPU tests skipped)}" >&2
bazel test ${config} --test_tag_filters=-gpu --build_tests_only=false \
  --local_test_jobs=1 //... 2>&1 | tee "$results_dir/bazel.log" >&2
bazel_rc=${PIPESTATUS[0]}
cp -r bazel-testlogs/ "$results_dir/bazel" 2>/dev/null || true

echo "== style (clang-format, ruff)" >&2
tools/check_style.sh "$results_dir/style.xml" >&2

python_rc=0
if [[ -x tools/test_python.sh ]]; then
  echo "== python tests" >&2
  tools/test_python.sh "$results_dir/pytest.xml" >&2
  python_rc=$?
fi

if [[ $bazel_rc -eq 1 ]]; then
  # Repeated last, where a reader of the log's tail sees it.
  echo "== the Bazel build failed:" >&2
  grep -E "^(ERROR|FAILED)|error:|fatal error" "$results_dir/bazel.log" | head -20 >&2
fi
python3 tools/count_results.py "$results_dir" --bazel_rc "$bazel_rc" \
  --python_rc "$python_rc"
