#!/usr/bin/env bash
# Runs the Python tests (client/python/tests, tests/reliability, tests/deploy
# and the docs check in tests/docs) against
# the real server in bazel-bin/server/detlogp_server (and detlogp.ops against
# bazel-bin/kernels/capi/libdetlogp_ops.so), writing JUnit XML.
#
# Usage: tools/test_python.sh <junit-xml-path>
#
# Uses a venv in .venv-ci/ (created when missing), installs the detlogp
# package (compiling its CPU ops library), the test dependencies and PyTorch
# from PyPI, and, for the fuzz test, clang with libFuzzer from Debian when
# missing. Exits non-zero on failure.
set -uo pipefail
cd "$(dirname "$0")/.."
xml=${1:?usage: tools/test_python.sh <junit-xml-path>}
xml=$(realpath -m "$xml")
venv=${DETLOGP_VENV:-.venv-ci}

# The server, the CLI (whose --help the docs check reads), the trainer-side
# ops library (detlogp.ops, tests/test_ops.py) and the C++ client's library
# (detlogp.engine, large calls), always through Bazel (a no-op
# when current): a binary left in bazel-bin by an earlier build must never
# stand in for this tree's.
echo "building //server:detlogp_server //client:detlogp_cli //kernels/capi:libdetlogp_ops.so //client/capi:libdetlogp_client.so" >&2
bazel build $(tools/bazel_config.sh 2>/dev/null) //server:detlogp_server \
  //client:detlogp_cli //kernels/capi:libdetlogp_ops.so //client/capi:libdetlogp_client.so >&2 || exit 1

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
# The package compiles its CPU ops library (client/python/setup.py):
# tests/test_ops.py checks the installed one against the server too. The
# C++ engine is required (DETLOGP_BUILD_CLIENT=1): every call larger than
# one request goes through it, so the tests never run without it.
DETLOGP_BUILD_CLIENT=1 "$venv/bin/python" -m pip install -q "./client/python[test]" pyyaml >&2 ||
  exit 1

# PyTorch, run on the CPU, for the torch tests (detlogp.torch and its
# autograd, torch.compile on the CPU, which compiles with g++, torch inputs).
# PyPI's Linux torch is the CUDA build: with its dependencies, ~4 GB of
# nvidia-* wheels, it installs in ~6 minutes here. The light install is torch
# without them, its pure-Python dependencies, and the four CUDA libraries
# that the machine's CUDA toolkit (/usr/local/cuda/lib64) lacks or has too
# old, at the versions torch's metadata names; the toolkit serves the rest,
# loaded and never called on the CPU (~2 minutes, ~1.9 GB). Where `import
# torch` still fails (another toolkit, or none), the full install follows.
torch_version=2.15.0
torch_light=(
  "torch==$torch_version"
  "nvidia-cufile==1.17.1.22.*"
  "nvidia-cusparselt-cu13==0.8.1"
  "nvidia-nvshmem-cu13==3.7.2"
  "nvidia-nccl-cu13==2.30.7"
)
torch_python_deps=(filelock "typing-extensions>=4.13.0" "setuptools>=77.0.3"
  "sympy>=1.13.3" "networkx>=2.5.1" jinja2 "fsspec>=0.8.5")
torch_ok() {
  "$venv/bin/python" -c "import sys, torch
sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null
}
if ! torch_ok; then
  echo "installing PyTorch $torch_version (CPU use) for the torch tests" >&2
  "$venv/bin/python" -m pip install -q --no-deps "${torch_light[@]}" >&2 &&
    "$venv/bin/python" -m pip install -q "${torch_python_deps[@]}" >&2
  if ! torch_ok; then
    echo "the light PyTorch install does not import here: installing torch" \
      "with its CUDA dependencies" >&2
    "$venv/bin/python" -m pip install -q "torch==$torch_version" >&2 || exit 1
  fi
  torch_ok || { echo "ERROR: import torch fails in $venv" >&2; exit 1; }
fi

# Non-editable install: the tests import the installed package, as users do.
"$venv/bin/python" -m pytest -p no:cacheprovider --import-mode=importlib \
  -o junit_family=xunit1 --junitxml="$xml" -s -rs -v --durations=15 \
  client/python/tests tests/reliability tests/deploy tests/docs
rc=$?
exit $rc
