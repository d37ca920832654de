#!/bin/bash
# Wall time of single-server full uploads with the CLI: starts one CPU server
# with a [32768, 4096] bf16 head (256 MiB) and uploads another head of that
# shape N times, printing each upload's seconds and the median.
#
# Usage: tools/bench/upload_time.sh [BIN_DIR] [N]
#   BIN_DIR holds detlogp_server and detlogp_cli (default: bazel-bin's); run
#   it for two builds, interleaved, to compare them.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
if [ -n "${1:-}" ]; then
  server=$1/detlogp_server cli=$1/detlogp_cli
else
  server=$repo/bazel-bin/server/detlogp_server cli=$repo/bazel-bin/client/detlogp_cli
fi
n=${2:-5}
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'kill $pid 2>/dev/null || true; rm -rf "$work"' EXIT
PYTHONPATH=$repo/client/python "$python" - "$work" <<'PY'
import sys
import numpy as np
from detlogp import safetensors_io, tensors
rng = np.random.default_rng(0)
for i in range(2):
    w = rng.standard_normal((32768, 4096), dtype=np.float32) * 0.02
    safetensors_io.write(f"{sys.argv[1]}/h{i}.safetensors",
                         {"lm_head.weight": tensors.float32_to_bf16_bits(w)})
PY
"$server" --device=cpu --cpu_threads=1 --port=0 --port_file="$work/port" \
    --weights="$work/h0.safetensors" >"$work/log" 2>&1 &
pid=$!
for _ in $(seq 600); do [ -s "$work/port" ] && break; sleep 0.1; done
port=$(head -1 "$work/port")
times=()
for i in $(seq "$n"); do
  start=$(date +%s.%N)
  "$cli" upload --target="127.0.0.1:$port" --model=default \
      --weights_file="$work/h$((i % 2)).safetensors" >/dev/null 2>&1
  times+=("$(echo "$(date +%s.%N) - $start" | bc)")
done
printf '%s\n' "${times[@]}"
printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR]=$1} END {
  m = NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2
  printf "median %.3f s of %d uploads\n", m, NR }'
