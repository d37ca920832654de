#!/usr/bin/env bash
# Runs on the device machine, from the repository root, with .device/serve
# carried (made by tools/device/build_serve.sh):
#   1. the GPU bitwise tests of both kernels (Bazel-built binaries);
#   2. the server on the GPU (H=4096, V=151936): bit invariance over gRPC,
#      end-to-end throughput (N=256, 64 callers) and small-call latency;
#   3. the H3 projection served from the GPU and from the CPU: equal digests
#      of Y's bits and equal determinism keys;
#   4. with SWEEP set, the load again against other server configurations.
set -uo pipefail
dir=.device/serve
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
status=0

start_server() {  # $1 = port file, rest = flags
  local port_file=$1; shift
  rm -f "$port_file"
  "$dir/detlogp_server" --port=0 --port_file="$port_file" --metrics_port=0 "$@" &
  for _ in $(seq 1 900); do [[ -s $port_file ]] && break; sleep 0.2; done
}

scrape() { curl -s "http://127.0.0.1:$(sed -n 2p "$1")/metrics"; }

# Runs serve_throughput against the server of port file $1 with load flags
# "rest", then says where the server's time went (metrics_delta.py).
load_phase() {
  local port_file=$1; shift
  local seconds warmup
  seconds=$(sed -n 's/.*--seconds=\([0-9.]*\).*/\1/p' <<< "$*")
  warmup=$(sed -n 's/.*--warmup_seconds=\([0-9.]*\).*/\1/p' <<< "$*")
  scrape "$port_file" > /tmp/metrics_before.txt
  local rc=0
  "$dir/serve_throughput" --target="127.0.0.1:$(head -1 "$port_file")" "$@" || rc=1
  scrape "$port_file" > /tmp/metrics_after.txt
  python3 tools/device/metrics_delta.py /tmp/metrics_before.txt /tmp/metrics_after.txt \
    "$(python3 -c "print(${seconds:-10} + ${warmup:-2})")"
  return $rc
}

# SWEEP_ONLY=1 runs the sweep alone (server configurations, no tests).
if [[ "${SWEEP_ONLY:-0}" != 1 ]]; then
echo "== GPU tests"
for test in linear_logp_cuda_test projection_cuda_test projection_backend_cuda_test; do
  "$dir/$test" > "$OUT/$test.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|tests? from .* ran" "$OUT/$test.log"
  # On a GPU machine every case must run: none skipped, and more than zero.
  if grep -q "SKIPPED \]" "$OUT/$test.log" || grep -q "PASSED  \] 0 tests" "$OUT/$test.log"; then
    echo "$test: cases skipped or none ran"; status=1
  fi
done

echo "== GPU server, H=4096 V=151936"
start_server /tmp/gpu.port --device=cuda:0 \
  --synthetic_hidden_size=4096 --synthetic_vocab_size=151936 \
  --max_batch_rows=${MAX_BATCH_ROWS:-4096} --max_queue_delay_us=${QUEUE_DELAY_US:-0} \
  --max_queue_rows=262144 > "$OUT/server.log" 2>&1
gpu_server=$!
target=127.0.0.1:$(head -1 /tmp/gpu.port)
grep -E "backend|serving|unavailable|projection" "$OUT/server.log"

echo "== bits over gRPC: probes alone vs mixed into 64 concurrent callers"
"$dir/detlogp_cli" check-invariance --target="$target" --probes=32 \
  --concurrency=64 --calls_per_thread=4 --channels=8 | tee "$OUT/invariance.txt" || status=1

echo "== bits over gRPC with entropy and top-k mixed in (issue #11)"
"$dir/detlogp_cli" check-invariance --target="$target" --probes=32 \
  --concurrency=64 --calls_per_thread=4 --channels=8 --entropy --top_k=20 \
  | tee "$OUT/invariance_extras.txt" || status=1
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "== Python load generator, extras mixed (needs .whl: grpcio, protobuf)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/serve-site .whl/*.whl
  PYTHONPATH=/tmp/serve-site:$PWD/client/python timeout 120 python3 \
    tests/load/detlogp_load.py --target "$target" --clients 32 --channels 8 \
    --duration 15 --json_out "$OUT/load_extras.json" 2>&1 | tail -15 || status=1
fi

echo "== end to end: N=256 rows per request, 64 callers, 16 channels"
load_phase /tmp/gpu.port --rows=256 --callers=64 --channels=16 --seconds=10 \
  | tee "$OUT/throughput_256.json" || status=1
echo "== small calls: N=16, 8 callers; then one caller"
load_phase /tmp/gpu.port --rows=16 --callers=8 --channels=8 --seconds=5 \
  | tee "$OUT/latency_16.json" || status=1
load_phase /tmp/gpu.port --rows=16 --callers=1 --channels=1 --seconds=3 | tail -2 || status=1
curl -s "http://127.0.0.1:$(sed -n 2p /tmp/gpu.port)/metrics" > "$OUT/metrics.txt" 2>/dev/null

echo "== projection from the GPU"
"$dir/detlogp_cli" project --target="$target" --project_rows=37296 --seed=7 \
  | tee "$OUT/project_gpu.txt" || status=1
kill -TERM $gpu_server; wait $gpu_server; echo "GPU server exit code $?"

echo "== projection from the CPU (same seeded rows)"
start_server /tmp/cpu.port --device=cpu > "$OUT/server_cpu.log" 2>&1
cpu_server=$!
"$dir/detlogp_cli" project --target=127.0.0.1:$(head -1 /tmp/cpu.port) \
  --project_rows=37296 --seed=7 | tee "$OUT/project_cpu.txt" || status=1
kill -TERM $cpu_server; wait $cpu_server
if [[ "$(grep -v seconds "$OUT/project_gpu.txt" | cut -d' ' -f1-2)" == \
      "$(grep -v seconds "$OUT/project_cpu.txt" | cut -d' ' -f1-2)" ]]; then
  echo "projection: GPU == CPU bits (same digest, same key)"
else
  echo "projection: GPU and CPU DIFFER"; status=1
fi
fi  # SWEEP_ONLY
if [[ -n "${SWEEP:-}" ]]; then
  # Each entry threads:delay_us:rows[:spin_us[:qos]], e.g. "4:300:2048 4:0:2048:0";
  # "qos" holds /dev/cpu_dma_latency at 0 (no deep CPU sleep states) meanwhile.
  # SWEEP_LARGE=0 skips the N=256 load.
  echo "== sweep: server configurations (N=256 x 64 callers; N=16 x 8 callers; N=16 x 1)"
  for config in $SWEEP; do
    IFS=: read -r threads delay rows spin qos <<< "$config"
    qos_holder=""
    if [[ "$qos" == qos ]]; then
      python3 -c 'import os, struct, time
fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY); os.write(fd, struct.pack("i", 0)); time.sleep(3600)' &
      qos_holder=$!
    fi
    start_server /tmp/sweep.port --device=cuda:0 --synthetic_hidden_size=4096 \
      --synthetic_vocab_size=151936 --batch_threads=$threads \
      --max_queue_delay_us=$delay --max_batch_rows=$rows --max_queue_rows=262144 \
      --batch_spin_us=${spin:--1} \
      > "$OUT/server_sweep.log" 2>&1
    sweep_server=$!
    echo "-- batch_threads=$threads max_queue_delay_us=$delay max_batch_rows=$rows batch_spin_us=${spin:--1} ${qos:+cpu_dma_latency=0}"
    if [[ "${SWEEP_LARGE:-1}" != 0 ]]; then
      load_phase /tmp/sweep.port --rows=256 --callers=64 --channels=16 \
        --seconds=8 --warmup_seconds=2 | tail -2
    fi
    load_phase /tmp/sweep.port --rows=16 --callers=8 --channels=8 \
      --seconds=4 --warmup_seconds=1 | tail -2
    load_phase /tmp/sweep.port --rows=16 --callers=1 --channels=1 \
      --seconds=3 --warmup_seconds=1 | tail -2
    kill -TERM $sweep_server; wait $sweep_server
    [[ -n "$qos_holder" ]] && kill $qos_holder
  done
fi
if [[ -f .device/logp/liblogp_bench.so ]]; then
  echo "== kernel only, same batch sizes (no transport)"
  LD_LIBRARY_PATH="$PWD/.device/logp/lib:$LD_LIBRARY_PATH" python3 tools/device/logp_bench.py \
    --ns 16,256,2048,4096 --reps 20 --no-torch 2>&1 | tail -8
fi
echo "overall status $status"
exit $status
