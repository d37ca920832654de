#!/usr/bin/env bash
# Runs on a two-GPU device machine (kind nvidia-h200-x2) with .device/serve
# carried: the kernel's GPU tests (sharded splits included); then the same
# rows scored on GPU 0, on GPU 1, on both with replicated weights
# (cuda:all) and on both with the vocabulary split between them
# (--vocab_parallel) must give identical bits under one determinism key;
# then throughput of each mode, and new versions uploaded while 64 callers
# score (replicated and vocabulary-parallel: every answer checked against
# the row alone on the version it names).
set -uo pipefail
dir=.device/serve
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L
status=0
model=(--synthetic_hidden_size=4096 --synthetic_vocab_size=151936 --max_queue_rows=262144
       --max_batch_rows=4096 --max_queue_delay_us=0)

"$dir/linear_logp_cuda_test" > "$OUT/linear_logp_cuda_test.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED) +\]|SKIPPED \]" "$OUT/linear_logp_cuda_test.log"

start_server() {  # $1 = name, rest = flags; sets ${name}_target and ${name}_pid
  local name=$1; shift
  rm -f "/tmp/$name.port"
  "$dir/detlogp_server" --port=0 --port_file="/tmp/$name.port" "${model[@]}" "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  eval "${name}_pid=$!"
  for _ in $(seq 1 900); do [[ -s /tmp/$name.port ]] && break; sleep 0.2; done
  eval "${name}_target=127.0.0.1:$(head -1 /tmp/$name.port)"
  grep -E "backend |cannot" "$OUT/server_$name.log"
}
score() {  # $1 = target: 512 seeded random rows, printed exactly (%.9g)
  "$dir/detlogp_cli" score --target="$1" --random_rows=512 --seed=42 --return_lse
}
same() {  # $1 $2 = score files, $3 = what
  if cmp -s "$1" "$2"; then echo "$3: identical bits and key"; else echo "$3: DIFFER"; status=1; fi
}
swap() {  # $1 = target: a new 1.24 GB version every 2 s for 8 s under load
  "$dir/swap_under_load" --target="$1" --callers=64 --channels=16 --rows=256 \
    --steady_seconds=3 --swap_seconds=8 --swap_every_seconds=2 || status=1
}
throughput() {  # $1 = target, $2 = callers
  "$dir/serve_throughput" --target="$1" --rows=256 --callers="$2" --channels=16 \
    --seconds=6 --warmup_seconds=2 | tail -1
}

start_server gpu0 --device=cuda:0
start_server gpu1 --device=cuda:1
score "$gpu0_target" > "$OUT/score_gpu0.txt"
score "$gpu1_target" > "$OUT/score_gpu1.txt"
same "$OUT/score_gpu0.txt" "$OUT/score_gpu1.txt" "GPU 1 vs GPU 0"
echo "== one GPU, N=256 x 64 callers"; throughput "$gpu0_target" 64
kill -TERM $gpu0_pid $gpu1_pid; wait

start_server all --device=cuda:all --max_versions_per_model=16
score "$all_target" > "$OUT/score_all.txt"
same "$OUT/score_gpu0.txt" "$OUT/score_all.txt" "cuda:all (replicated) vs GPU 0"
echo "== cuda:all, versions uploaded under load"; swap "$all_target"
kill -TERM $all_pid; wait

start_server vocab --device=cuda:all --vocab_parallel --max_versions_per_model=16
score "$vocab_target" > "$OUT/score_vocab.txt"
same "$OUT/score_gpu0.txt" "$OUT/score_vocab.txt" "vocabulary-parallel (2 GPUs) vs GPU 0"
"$dir/detlogp_cli" check-invariance --target="$vocab_target" --probes=16 \
  --concurrency=32 --calls_per_thread=4 --channels=8 || status=1
echo "== vocabulary-parallel, N=256 x 64 callers"; throughput "$vocab_target" 64
echo "== vocabulary-parallel, versions uploaded under load"; swap "$vocab_target"
kill -TERM $vocab_pid; wait
echo "overall status $status"
exit $status
