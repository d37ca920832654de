#!/usr/bin/env bash
# Builds and starts the detlogp server. Arguments go to the server; with none
# it serves the embedded synthetic model on 127.0.0.1:50051.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
bazel build $(tools/bazel_config.sh) //server:detlogp_server //client:detlogp_cli >&2
exec bazel-bin/server/detlogp_server "$@"
