#!/usr/bin/env bash
# Runs on a two-GPU device machine (kind nvidia-h200-x2) with .device/serve
# carried: the same rows scored on GPU 0, on GPU 1 and on both (cuda:all)
# must give identical bits under one determinism key; then throughput of one
# GPU against both, and small-call latency.
set -uo pipefail
dir=.device/serve
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L
status=0
model=(--synthetic_hidden_size=4096 --synthetic_vocab_size=151936 --max_queue_rows=262144)

start_server() {  # $1 = name, rest = flags; sets $target
  local name=$1; shift
  rm -f "/tmp/$name.port"
  "$dir/detlogp_server" --port=0 --port_file="/tmp/$name.port" "${model[@]}" "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  eval "${name}_pid=$!"
  for _ in $(seq 1 900); do [[ -s /tmp/$name.port ]] && break; sleep 0.2; done
  eval "${name}_target=127.0.0.1:$(head -1 /tmp/$name.port)"
  grep -E "backend " "$OUT/server_$name.log"
}
score() {  # $1 = target: 512 seeded random rows, printed exactly (%.9g)
  "$dir/detlogp_cli" score --target="$1" --random_rows=512 --seed=42 --return_lse
}

start_server gpu0 --device=cuda:0 --max_batch_rows=4096 --max_queue_delay_us=0
start_server gpu1 --device=cuda:1 --max_batch_rows=4096 --max_queue_delay_us=0
score "$gpu0_target" > "$OUT/score_gpu0.txt"
score "$gpu1_target" > "$OUT/score_gpu1.txt"
if cmp -s "$OUT/score_gpu0.txt" "$OUT/score_gpu1.txt"; then
  echo "GPU 0 == GPU 1: 512 rows, identical bits and key ($(head -1 "$OUT/score_gpu0.txt"))"
else
  echo "GPU 0 and GPU 1 DIFFER"; status=1
fi
echo "== one GPU: N=256 x 64 callers; N=16 x 8 callers"
"$dir/serve_throughput" --target="$gpu0_target" --rows=256 --callers=64 --channels=16 --seconds=8 | tail -1
"$dir/serve_throughput" --target="$gpu0_target" --rows=16 --callers=8 --channels=8 --seconds=4 | tail -1
kill -TERM $gpu0_pid $gpu1_pid; wait

start_server all --device=cuda:all --max_batch_rows=4096 --max_queue_delay_us=0
score "$all_target" > "$OUT/score_all.txt"
if cmp -s "$OUT/score_gpu0.txt" "$OUT/score_all.txt"; then
  echo "cuda:all == GPU 0: identical bits and key"
else
  echo "cuda:all DIFFERS from GPU 0"; status=1
fi
"$dir/detlogp_cli" check-invariance --target="$all_target" --probes=32 \
  --concurrency=64 --calls_per_thread=4 --channels=8 || status=1
echo "== both GPUs: N=256 x 128 callers"
"$dir/serve_throughput" --target="$all_target" --rows=256 --callers=128 --channels=16 --seconds=8 | tail -1
kill -TERM $all_pid; wait
echo "overall status $status"
exit $status
