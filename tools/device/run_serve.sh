#!/usr/bin/env bash
# Runs on the device machine, from the repository root, with .device/serve
# carried: serves H=4096, V=151936 from the GPU, checks bit invariance over
# gRPC, then measures end-to-end throughput and small-call latency.
set -uo pipefail
dir=.device/serve
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"

"$dir/detlogp_server" --device=cuda:0 --port=0 --port_file=/tmp/port \
  --synthetic_hidden_size=4096 --synthetic_vocab_size=151936 \
  --max_batch_rows=${MAX_BATCH_ROWS:-2048} --max_queue_delay_us=${QUEUE_DELAY_US:-300} \
  --max_queue_rows=262144 --metrics_port=0 > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 1 600); do [[ -s /tmp/port ]] && break; sleep 0.2; done
port=$(head -1 /tmp/port)
target=127.0.0.1:$port
echo "== server on $target"; grep -E "backend|serving|unavailable" "$OUT/server.log"

echo "== bits over gRPC (probes alone vs mixed, 64 callers)"
"$dir/detlogp_cli" check-invariance --target="$target" --probes=32 \
  --concurrency=64 --calls_per_thread=4 --channels=8 | tee "$OUT/invariance.txt"

echo "== throughput: N=256 rows per request, 64 callers, 8 channels"
"$dir/serve_throughput" --target="$target" --rows=256 --callers=64 --channels=8 \
  --seconds=${SECONDS_MEASURED:-10} | tee "$OUT/throughput_256.json"
echo "== latency: N=16, 8 callers"
"$dir/serve_throughput" --target="$target" --rows=16 --callers=8 --channels=8 \
  --seconds=5 | tee "$OUT/latency_16.json"
metrics_port=$(sed -n 2p /tmp/port)
curl -s "http://127.0.0.1:$metrics_port/metrics" > "$OUT/metrics.txt" 2>/dev/null || true
kill -TERM $server; wait $server; echo "server exit code $?"
tail -3 "$OUT/server.log"
