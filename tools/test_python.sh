#!/usr/bin/env bash
# Runs the Python tests (client/python/tests, tests/reliability, tests/deploy
# and the docs check in tests/docs) against
# the real server in bazel-bin/server/detlogp_server (and detlogp.ops against
# bazel-bin/kernels/capi/libdetlogp_ops.so), writing JUnit XML.
#
# Usage: tools/test_python.sh <junit-xml-path>
#
# Uses a venv in .venv-ci/ (created when missing), installs the detlogp
# package and the test dependencies from PyPI, and, for the fuzz test,
# clang with libFuzzer from Debian when missing. Exits non-zero on failure.
set -uo pipefail
cd "$(dirname "$0")/.."
xml=${1:?usage: tools/test_python.sh <junit-xml-path>}
xml=$(realpath -m "$xml")
venv=${DETLOGP_VENV:-.venv-ci}

# The server, the CLI (whose --help the docs check reads) and the trainer-side
# ops library (detlogp.ops, tests/test_ops.py), always through Bazel (a no-op
# when current): a binary left in bazel-bin by an earlier build must never
# stand in for this tree's.
echo "building //server:detlogp_server //client:detlogp_cli //kernels/capi:libdetlogp_ops.so" >&2
bazel build $(tools/bazel_config.sh 2>/dev/null) //server:detlogp_server \
  //client:detlogp_cli //kernels/capi:libdetlogp_ops.so >&2 || exit 1

# clang + libFuzzer for tests/reliability/fuzz (Debian 12: clang 14).
if ! command -v clang++ >/dev/null || ! compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null; then
  echo "installing clang and libclang-rt-14-dev for the fuzz target" >&2
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive $SUDO apt-get \
    install -y -qq --no-install-recommends clang libclang-rt-14-dev >&2 ||
    echo "WARNING: could not install clang; the fuzz test will fail" >&2
fi

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv" || exit 1
fi
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q "./client/python[test]" pyyaml >&2 || exit 1

# Non-editable install: the tests import the installed package, as users do.
"$venv/bin/python" -m pytest -p no:cacheprovider --import-mode=importlib \
  -o junit_family=xunit1 --junitxml="$xml" -s -rs -v --durations=15 \
  client/python/tests tests/reliability tests/deploy tests/docs
rc=$?
exit $rc
