#!/usr/bin/env bash
# Regenerates the checked-in Python stubs (detlogp/v1/detlogp_pb2*.py) from
# proto/detlogp/v1/detlogp.proto. Run it after editing the proto; the test
# tests/test_stubs_current.py fails while the stubs are stale.
#
# The generator is pinned so that the output is reproducible; pyproject.toml's
# protobuf floor must be at least the "Protobuf Python Version" written at the
# top of detlogp_pb2.py.
#
# Usage: client/python/tools/regen_stubs.sh [PYTHON]   (PYTHON needs pip)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$(cd "$here/../.." && pwd)
python=${1:-python3}
GRPCIO_TOOLS_VERSION=1.85.1

if ! "$python" -c "import grpc_tools, importlib.metadata as m, sys; sys.exit(m.version('grpcio-tools') != '$GRPCIO_TOOLS_VERSION')" 2>/dev/null; then
  venv="$here/.regen-venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "grpcio-tools==$GRPCIO_TOOLS_VERSION"
  python="$venv/bin/python"
fi
"$python" -m grpc_tools.protoc --proto_path="$repo/proto" \
  --python_out="$here" --grpc_python_out="$here" \
  "$repo/proto/detlogp/v1/detlogp.proto"
echo "regenerated: $(cd "$here" && ls detlogp/v1/detlogp_pb2*.py | tr '\n' ' ')" >&2
