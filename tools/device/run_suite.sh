#!/usr/bin/env bash
# start_server sets NAME_target, NAME_pid and NAME_metrics with printf -v.
# shellcheck disable=SC2154
# Runs one named suite on a GPU host from the bundle that
# tools/device/bundle.sh made: .device/bundle, or .device/bundle.tar.gz
# (unpacked into .device/bundle first) beside the tree; or run as the
# bundle's own scripts/run_suite.sh.
#
#   tools/device/run_suite.sh SUITE [ARGS...]
#
# Suites:
#   tests              every GPU test binary (tests tagged gpu; TESTS="a b"
#                      runs those alone); none may skip a case or run none
#                      (ALLOW_SKIPS=1 on a GPU that is not sm_90, where the
#                      Hopper cases skip)
#   kernels            the Hopper linear-logp kernel: its GPU tests,
#                      compute-sanitizer memcheck on small shapes, the kernel
#                      against PyTorch eager and the weight-read floor
#                      (logp_bench.py), entropy and top-k costs
#                      (logp_extras_bench.py), the wgmma rate bench. TUNING=1:
#                      item-order row groups and the portable kernel beside
#                      a staged RL-Kernel (RLKERNEL=DIR). LIBS="a.so b.so":
#                      an interleaved A/B of bench libraries (ab_summary.py).
#                      NCU=1: each kernel's duration under ncu; SASS_PROFILE=1:
#                      per-instruction stall samples of the split kernel
#   portable           the portable mma.sync kernel: memcheck on small shapes,
#                      its GPU tests, then served with --logp_kernel=portable
#                      (its own determinism key, bits over gRPC, served rows/s
#                      against the kernel alone: >= 0.85)
#   serve              the server on cuda:0 (H=4096, V=151936): bit invariance
#                      over gRPC with and without extras, throughput (N=256 x
#                      64 callers), small-call latency (16 rows from 8
#                      callers and from one, one row), the projection's bits
#                      from the GPU equal the CPU's; SWEEP="threads:delay_us:
#                      rows[:spin_us[:qos]] ..." compares server settings.
#                      With two or more GPUs (MULTI_GPU=0 skips): GPU 0 ==
#                      GPU 1 == cuda:all == --vocab_parallel bits, throughput,
#                      versions uploaded under load
#   live-weights       versions swapped under load with every answer's bits
#                      checked, two models, --model_root persistence and
#                      restart, the live-weights tests against a GPU server
#   projection         the projection's GPU tests, the kernels against
#                      PyTorch (projection_bench + projection_bench.py;
#                      NCU=1 adds ncu sections of the forward kernels)
#   projection-stream  one H3 video (364,608 rows, 7.8 GB) streamed from
#                      cuda:0 at each rows_per_chunk, one and four calls,
#                      four videos at once, the transport-only bench
#   twin               detlogp.torch on CUDA: the pytest cases (torch.compile
#                      and CUDA-graph replays among them), twin_check.py
#                      (the op's bits == the CUDA server's, gradients, memory)
#                      and examples/grpo_twin_step.py against a GPU server
#   rollout            the client's shared-memory and C++-client pytest
#                      cases on the GPU, then one caller's large batch
#                      through the Python client (system and CUDA regions,
#                      TCP, Unix socket) against detlogp.torch in the same
#                      process, and the bits of every path
#                      (rollout_worker_bench.py; ARGS go to it; PYTEST=0
#                      skips the pytest cases)
#   backward           the fused backward: the MN-major wgmma test, the
#                      backward's GPU tests, then forward + backward beside
#                      PyTorch eager and Liger (logp_backward_bench.py), and
#                      detlogp.torch's training step beside eager and
#                      torch.compile (twin_train_bench.py)
#
# Logs go to $OUT (default /tmp/detlogp-SUITE). Python packages the host
# lacks (grpcio, protobuf, liger-kernel) are installed from .whl/*.whl when
# present. Ends with "N passed, M failed"; exits non-zero on any failure,
# and with 2 when the host has no GPU or no bundle.
set -uo pipefail

usage="usage: run_suite.sh tests|kernels|portable|serve|live-weights|projection|projection-stream|twin|rollout|backward [ARGS...]"
suite=${1:-}
shift || true
case "$suite" in
  tests | kernels | portable | serve | live-weights | projection | \
    projection-stream | twin | rollout | backward) ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac

script_dir=$(cd "$(dirname "$0")" && pwd)
if [[ -n ${DETLOGP_BUNDLE:-} ]]; then
  bundle=$(cd "$DETLOGP_BUNDLE" 2> /dev/null && pwd || echo "$DETLOGP_BUNDLE")
elif [[ -x $script_dir/../bin/detlogp_server ]]; then
  bundle=$(cd "$script_dir/.." && pwd) # the bundle's own copy
else
  bundle=$(cd "$script_dir/../.." && pwd)/.device/bundle
  # bundle.sh's compressed copy, unpacked unless this very file was.
  if [[ -f $bundle.tar.gz ]]; then
    digest=$(sha256sum < "$bundle.tar.gz")
    if [[ $digest != "$(cat "$bundle/.unpacked_from" 2> /dev/null)" ]]; then
      rm -rf "$bundle"
      tar -C "$(dirname "$bundle")" -xzf "$bundle.tar.gz" &&
        echo "$digest" > "$bundle/.unpacked_from"
    fi
  fi
fi
bin=$bundle/bin
scripts=$bundle/scripts
if [[ ! -x $bin/detlogp_server ]]; then
  echo "run_suite.sh: no bundle at $bundle: run tools/device/bundle.sh on the build machine and copy .device/bundle.tar.gz here" >&2
  exit 2
fi
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L 2> /dev/null | grep -q "^GPU "; then
  echo "run_suite.sh: no NVIDIA GPU on this host (nvidia-smi is missing or lists none): the $suite suite runs on a GPU host" >&2
  exit 2
fi
OUT=${OUT:-/tmp/detlogp-$suite}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
servers=()
cleanup() {
  local pid
  for pid in "${servers[@]}"; do kill -TERM "$pid" 2> /dev/null; done
  wait 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT
echo "bundle $bundle ($(cat "$bundle/COMMIT" 2> /dev/null || echo "no commit")); logs in $OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.max.sm,power.draw \
  --format=csv | tee "$OUT/gpu.txt"

# --- results --------------------------------------------------------------
passed=0
failed=0
pass() {
  echo "PASS $*"
  passed=$((passed + 1))
}
fail() {
  echo "FAIL $*"
  failed=$((failed + 1))
}
# check NAME RC: PASS when RC is 0; returns RC's verdict.
check() {
  if [[ $2 -eq 0 ]]; then
    pass "$1"
  else
    fail "$1 (exit code $2)"
    return 1
  fi
}
finish() {
  echo "$passed passed, $failed failed"
  [[ $failed -eq 0 ]]
  exit $?
}

# --- helpers --------------------------------------------------------------
# run_gtest NAME [TIMEOUT_S] [GTEST ARGS...]: bin/NAME, log in $OUT/NAME.log;
# fails on a non-zero exit, a skipped case, or no case run.
run_gtest() {
  local name=$1 limit=${2:-600}
  shift 2 || shift
  local log=$OUT/$name.log
  if [[ ! -x $bin/$name ]]; then
    fail "$name: not in the bundle"
    return
  fi
  # Tests that start a server (ServerProcess) find it under TEST_SRCDIR.
  TEST_SRCDIR=${TEST_SRCDIR:-$bundle/runfiles} TEST_TMPDIR=${TEST_TMPDIR:-$work} \
    timeout "$limit" "$bin/$name" "$@" > "$log" 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED) +\]|^\[  SKIPPED \] [0-9]+ tests?,|tests? from .* ran" "$log"
  if [[ $rc -eq 124 ]]; then
    fail "$name: timed out after ${limit}s (log: $log)"
  elif [[ $rc -ne 0 ]]; then
    fail "$name: exit code $rc (log: $log)"
  elif grep -q "^\[  SKIPPED \]" "$log" && [[ ${ALLOW_SKIPS:-0} != 1 ]]; then
    fail "$name: cases skipped on a GPU host (log: $log)"
  elif grep -q "^\[  PASSED  \] 0 tests" "$log"; then
    fail "$name: no case ran (log: $log)"
  else
    pass "$name"
  fi
}

# memcheck NAME FILTER: compute-sanitizer on the GPU test's small shapes
# (the full-vocabulary cases are too slow under the tool).
memcheck() {
  local name=$1 filter=$2
  if ! command -v compute-sanitizer > /dev/null; then
    fail "memcheck $name: compute-sanitizer not found"
    return
  fi
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$bin/$name" --gtest_filter="$filter" > "$OUT/memcheck_$name.log" 2>&1
  local rc=$?
  tail -n 3 "$OUT/memcheck_$name.log"
  check "memcheck $name" $rc
}

# python_env: grpcio/protobuf (and any other wheel in .whl) when the host
# lacks them, the detlogp package, the ops libraries and the server.
python_env() {
  local site=$work/site wheels=()
  local dir
  for dir in "$bundle/../../.whl" "$bundle/whl" "$PWD/.whl"; do
    if compgen -G "$dir/*.whl" > /dev/null; then wheels=("$dir"/*.whl) && break; fi
  done
  if [[ ${#wheels[@]} -gt 0 ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" "${wheels[@]}" || echo "pip could not install ${wheels[*]}"
  fi
  export PYTHONPATH="$site:$bundle/python/client${PYTHONPATH:+:$PYTHONPATH}"
  export DETLOGP_OPS_LIBRARY=$bundle/lib/libdetlogp_ops.so
  export DETLOGP_OPS_CUDA_LIBRARY=$bundle/lib/libdetlogp_ops_cuda.so
  export DETLOGP_CLIENT_LIBRARY=$bundle/lib/libdetlogp_client.so
  export DETLOGP_SERVER=$bin/detlogp_server
  export DETLOGP_BUNDLE=$bundle
}

# start_server NAME FLAGS...: a server on free ports, its log in
# $OUT/server_NAME.log; sets NAME_pid, NAME_target, NAME_metrics (the
# metrics port). Fails (returns 1) when it does not come up in 180 s.
start_server() {
  local name=$1
  shift
  local port_file=$work/$name.port
  rm -f "$port_file"
  "$bin/detlogp_server" --port=0 --port_file="$port_file" --metrics_port=0 "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  local pid=$!
  servers+=("$pid")
  printf -v "${name}_pid" %s "$pid"
  for _ in $(seq 1 900); do
    [[ -s $port_file ]] && break # written whole, then renamed
    kill -0 "$pid" 2> /dev/null || break
    sleep 0.2
  done
  if [[ ! -s $port_file ]]; then
    fail "server $name did not start (log: $OUT/server_$name.log)"
    tail -n 5 "$OUT/server_$name.log"
    return 1
  fi
  printf -v "${name}_target" %s "127.0.0.1:$(sed -n 1p "$port_file")"
  printf -v "${name}_metrics" %s "$(sed -n 2p "$port_file")"
  grep -E "backend |serving|projection:|cannot|refused" "$OUT/server_$name.log"
}

# stop_server NAME: SIGTERM, then checks the drain's exit code.
stop_server() {
  local pid_var=${1}_pid
  kill -TERM "${!pid_var}" 2> /dev/null
  wait "${!pid_var}"
  check "server $1 exits cleanly" $?
}

scrape() { # $1 = metrics port
  python3 -c "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$1/metrics').read().decode())"
}

# load_phase NAME SERVE_THROUGHPUT FLAGS...: serve_throughput against the
# server NAME, then where the server's time went (metrics_delta.py).
load_phase() {
  local name=$1
  shift
  local target_var=${name}_target metrics_var=${name}_metrics
  local seconds warmup
  seconds=$(sed -n 's/.*--seconds=\([0-9.]*\).*/\1/p' <<< "$*")
  warmup=$(sed -n 's/.*--warmup_seconds=\([0-9.]*\).*/\1/p' <<< "$*")
  scrape "${!metrics_var}" > "$work/metrics_before.txt"
  "$bin/serve_throughput" --target="${!target_var}" "$@"
  local rc=$?
  scrape "${!metrics_var}" > "$work/metrics_after.txt"
  python3 "$scripts/metrics_delta.py" "$work/metrics_before.txt" "$work/metrics_after.txt" \
    "$(python3 -c "print(${seconds:-10} + ${warmup:-2})")"
  return $rc
}

synthetic_model=(--synthetic_hidden_size=4096 --synthetic_vocab_size=151936)

# --- suites ---------------------------------------------------------------
suite_tests() {
  local names name
  if [[ -n ${TESTS:-} ]]; then
    read -r -a names <<< "$TESTS"
  else
    mapfile -t names < "$bundle/gpu_tests.txt"
  fi
  for name in "${names[@]}"; do
    echo "== $name"
    run_gtest "$name" "${TEST_TIMEOUT:-600}"
  done
}

suite_kernels() {
  echo "== GPU tests of the Hopper kernel and the top-k pieces"
  run_gtest linear_logp_cuda_test 300
  run_gtest top_k_screens_test 120
  run_gtest top_k_floor_test 120
  echo "== memcheck, small shapes"
  memcheck linear_logp_cuda_test 'Edges/ShapeTest.*/V63_*:Edges/ShapeTest.*/V64_*:Edges/ShapeTest.*/V65_*:Edges/ShapeTest.*/V1_*:Edges/ShapeTest.*/V129_*:Edges/ShapeTest.*/V2049_*:Edges/ShapeTest.*/V4097_*:Edges/ShapeTest.*/V8191_*:LinearLogpCudaValidation.*:LinearLogpCudaExtras.RejectsBadTopK:LinearLogpCudaExtras.SmallVocabulariesAndPadding'
  local lib=$bundle/lib/liblogp_bench.so
  if command -v cuobjdump > /dev/null; then
    # The Hopper kernel multiplies with wgmma and keeps its state in
    # registers: HGMMA present, no local memory.
    cuobjdump --dump-sass "$lib" > "$work/sass.txt" 2> /dev/null
    echo "SASS of liblogp_bench.so: $(grep -c HGMMA "$work/sass.txt") HGMMA, $(grep -cE 'LDL|STL' "$work/sass.txt") local memory instructions"
  fi
  echo "== the kernel against PyTorch eager and the weight-read floor"
  timeout 300 python3 "$scripts/logp_bench.py" --lib "$lib" --json "$OUT/bench.json" "$@" \
    2>&1 | tee "$OUT/bench.log"
  check "logp_bench.py" "${PIPESTATUS[0]}"
  echo "== entropy and top-k"
  timeout 300 python3 "$scripts/logp_extras_bench.py" --lib "$lib" --json "$OUT/extras.json" \
    2>&1 | tee "$OUT/extras.log"
  check "logp_extras_bench.py" "${PIPESTATUS[0]}"
  echo "== wgmma rate: one warpgroup's chain against two"
  timeout 120 "$bin/wgmma_rate_bench" 2>&1 | tee "$OUT/wgmma_rate.log"
  check "wgmma_rate_bench" "${PIPESTATUS[0]}"
  if [[ ${TUNING:-0} == 1 ]]; then
    echo "== item order: row groups (every group's bits checked)"
    timeout 300 python3 "$scripts/logp_row_group_bench.py" --lib "$lib" --groups 8,16,32,64 \
      --ns 1024,2048,4096,8192 --reps 15 2>&1 | tee "$OUT/row_groups.log"
    check "logp_row_group_bench.py" "${PIPESTATUS[0]}"
    local rlkernel=()
    [[ -n ${RLKERNEL:-} ]] && rlkernel=(--rlkernel "$RLKERNEL")
    timeout 300 python3 "$scripts/logp_portable_bench.py" --lib "$lib" \
      --ns 64,1024,2048,4096,8192 --reps 15 "${rlkernel[@]}" 2>&1 | tee "$OUT/portable.log"
    check "logp_portable_bench.py" "${PIPESTATUS[0]}"
  fi
  if [[ -n ${LIBS:-} ]]; then
    # Rounds alternate the order (a b, then b a, ...): in interleaved timing
    # a kernel starts at the clock the one before it left, so libraries are
    # compared within one run, and the same seed's digests across them.
    local libs round i order
    read -r -a libs <<< "$LIBS"
    for round in $(seq 1 "${ROUNDS:-2}"); do
      order=("${libs[@]}")
      if ((round % 2 == 0)); then
        order=()
        for ((i = ${#libs[@]} - 1; i >= 0; --i)); do order+=("${libs[i]}"); done
      fi
      for lib in "${order[@]}"; do
        echo "== round $round $lib"
        timeout "${BENCH_TIMEOUT:-300}" python3 "$scripts/logp_extras_bench.py" --lib "$lib" \
          --kernel "${KERNEL:-hopper}" --seed 8 --ns "${NS:-1024,2048,4096}" \
          --reps "${REPS:-21}" --no-torch 2>&1 | grep -E "^N=|FAIL|PASS|^ +[0-9]+ "
      done
    done | tee "$OUT/ab.log"
    python3 "$scripts/ab_summary.py" "$OUT/ab.log"
    check "A/B of $LIBS" $?
  fi
  if [[ ${NCU:-0} == 1 ]]; then
    # ncu serialises the kernels: read each one's duration, not their sum.
    # One profiled run per N: the persistent split kernel's grid is the SM
    # count at every N, so only the run tells its launches apart.
    local n csv
    for n in ${NCU_NS:-1024 4096}; do
      csv=$OUT/durations_n$n.csv
      timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum \
        --kernel-name "${KERNELS:-regex:LinearLogp|Combine}" --csv --page raw \
        python3 "$scripts/logp_extras_bench.py" --lib "$lib" --kernel "${KERNEL:-hopper}" \
        --seed 8 --ns "$n" --reps 3 --no-torch > "$csv" 2> "$OUT/durations_n$n.log"
      echo "== kernel durations, N=$n"
      grep -E "^N=" "$csv"
      python3 "$scripts/kernel_durations_summary.py" "$csv"
      check "kernel durations N=$n" $?
    done
  fi
  if [[ ${SASS_PROFILE:-0} == 1 ]]; then
    # Warp-stall samples and instructions executed per SASS instruction of
    # one launch of the split kernel, logp-only and top-20.
    local variant name topk rep
    for variant in logp:0 top20:1; do
      name=${variant%%:*}
      topk=${variant##*:}
      rep=$work/sass_$name
      timeout 240 ncu --clock-control none --kernel-name-base demangled \
        --kernel-name "regex:LinearLogpSplitKernel<.bool.0, .bool.$topk>" \
        --launch-skip 1 --launch-count 1 \
        --section SourceCounters --section WarpStateStats -o "$rep" -f \
        python3 "$scripts/logp_extras_bench.py" --lib "$lib" --kernel hopper \
        --seed 8 --ns "${N:-1024}" --reps 3 --no-torch > "$rep.log" 2>&1
      ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_sass.csv"
      ncu -i "$rep.ncu-rep" --page raw --csv > "$OUT/${name}_raw.csv"
      python3 "$scripts/sass_profile_summary.py" "$OUT/${name}_sass.csv" | head -40
      check "SASS profile $name" "${PIPESTATUS[0]}"
    done
  fi
}

suite_portable() {
  echo "== memcheck, small shapes"
  memcheck linear_logp_portable_test 'LinearLogpPortableVersion.*:Edges/PortableShapeTest.*/V1_*:Edges/PortableShapeTest.*/V63_*:Edges/PortableShapeTest.*/V65_*H64*:LinearLogpPortableInputs.*:LinearLogpPortableExtras.RejectsBadTopK:LinearLogpPortableExtras.SmallVocabulariesAndPadding'
  echo "== GPU tests of the portable kernel"
  run_gtest linear_logp_portable_test 400
  echo "== the Hopper kernel's determinism key, for comparison"
  start_server hopper --device=cuda:0 --logp_kernel=hopper "${synthetic_model[@]}" || return
  "$bin/detlogp_cli" info --target="$hopper_target" > "$OUT/info_hopper.txt"
  stop_server hopper
  local hopper_key portable_key
  hopper_key=$(sed -n 's/^determinism_key: "\(.*\)"/\1/p' "$OUT/info_hopper.txt")
  echo "== served with --logp_kernel=portable"
  start_server portable --device=cuda:0 --logp_kernel=portable "${synthetic_model[@]}" \
    --max_queue_rows=262144 || return
  grep -q "kernel portable-mma-sync-v1" "$OUT/server_portable.log"
  check "the server's log names the portable kernel" $?
  "$bin/detlogp_cli" info --target="$portable_target" > "$OUT/info_portable.txt"
  grep -E "backend|kernel_version|determinism_key" "$OUT/info_portable.txt"
  grep -q 'kernel_version: "portable-mma-sync-v1"' "$OUT/info_portable.txt"
  check "ModelInfo names the portable kernel" $?
  grep -q 'isa sm_90/sass_sm_90' "$OUT/info_portable.txt"
  check "ModelInfo.backend names the sm_90 cubin" $?
  portable_key=$(sed -n 's/^determinism_key: "\(.*\)"/\1/p' "$OUT/info_portable.txt")
  [[ -n $portable_key && -n $hopper_key && $portable_key != "$hopper_key" ]]
  check "keys exist and differ (portable $portable_key, hopper $hopper_key)" $?
  echo "== bits over gRPC: probes alone vs mixed into 64 concurrent callers"
  "$bin/detlogp_cli" check-invariance --target="$portable_target" --probes=32 \
    --concurrency=64 --calls_per_thread=4 --channels=8 | tee "$OUT/invariance.txt"
  check "invariance" "${PIPESTATUS[0]}"
  "$bin/detlogp_cli" check-invariance --target="$portable_target" --probes=32 \
    --concurrency=64 --calls_per_thread=4 --channels=8 --entropy --top_k=20 \
    | tee "$OUT/invariance_extras.txt"
  check "invariance with entropy and top-20" "${PIPESTATUS[0]}"
  echo "== served rows/s: N=256 rows per request, 64 callers, 16 channels"
  "$bin/serve_throughput" --target="$portable_target" --rows=256 --callers=64 --channels=16 \
    --seconds=10 --warmup_seconds=2 | tee "$OUT/throughput_256.txt"
  check "serve_throughput" "${PIPESTATUS[0]}"
  stop_server portable
  local served
  served=$(grep -o '"rows_per_s": [0-9.]*' "$OUT/throughput_256.txt" | head -1 | awk '{print $2}')
  echo "== the kernel alone (no transport), same run"
  python3 "$scripts/logp_portable_bench.py" --lib "$bundle/lib/liblogp_bench.so" \
    --ns 256,4096 --reps 20 2>&1 | tee "$OUT/kernel_only.txt"
  check "logp_portable_bench.py" "${PIPESTATUS[0]}"
  local ms_256 ms_4096
  ms_256=$(awk '$1 == 256 {print $2}' "$OUT/kernel_only.txt" | head -1)
  ms_4096=$(awk '$1 == 4096 {print $2}' "$OUT/kernel_only.txt" | head -1)
  if [[ -z $served || -z $ms_256 ]]; then
    fail "served vs kernel-only: could not read served ($served) or kernel-only ($ms_256)"
    return
  fi
  python3 - "$served" "$ms_256" "${ms_4096:-0}" << 'PY' | tee "$OUT/served_vs_kernel.txt"
import sys
served, ms256, ms4096 = (float(x) for x in sys.argv[1:])
k256 = 256 / (ms256 / 1e3)
ratio = served / k256
print(f"served {served:.0f} rows/s; kernel-only N=256 {k256:.0f} rows/s; ratio {ratio:.3f} (target >= 0.85)")
if ms4096 > 0:
    k4096 = 4096 / (ms4096 / 1e3)
    print(f"kernel-only N=4096 {k4096:.0f} rows/s; served / that {served / k4096:.3f}")
sys.exit(0 if ratio >= 0.85 else 1)
PY
  check "served / kernel-only rows/s >= 0.85" "${PIPESTATUS[0]}"
}

suite_serve() {
  python_env
  if [[ ${SWEEP_ONLY:-0} != 1 ]]; then
    echo "== GPU server, H=4096 V=151936"
    start_server gpu --device=cuda:0 "${synthetic_model[@]}" \
      --max_batch_rows="${MAX_BATCH_ROWS:-4096}" --max_queue_delay_us="${QUEUE_DELAY_US:-0}" \
      --max_queue_rows=262144 || return
    echo "== bits over gRPC: probes alone vs mixed into 64 concurrent callers"
    "$bin/detlogp_cli" check-invariance --target="$gpu_target" --probes=32 \
      --concurrency=64 --calls_per_thread=4 --channels=8 | tee "$OUT/invariance.txt"
    check "invariance" "${PIPESTATUS[0]}"
    "$bin/detlogp_cli" check-invariance --target="$gpu_target" --probes=32 \
      --concurrency=64 --calls_per_thread=4 --channels=8 --entropy --top_k=20 \
      | tee "$OUT/invariance_extras.txt"
    check "invariance with entropy and top-20" "${PIPESTATUS[0]}"
    if python3 -c "import grpc, google.protobuf" 2> /dev/null; then
      echo "== Python load generator, extras mixed in"
      timeout 120 python3 "$scripts/detlogp_load.py" --target "$gpu_target" --clients 32 \
        --channels 8 --duration 15 --json_out "$OUT/load_extras.json" 2>&1 | tail -15
      check "detlogp_load.py" "${PIPESTATUS[0]}"
    else
      echo "no grpcio/protobuf for python3 (put their wheels in .whl): Python load generator left out"
    fi
    echo "== end to end: N=256 rows per request, 64 callers, 16 channels"
    load_phase gpu --rows=256 --callers=64 --channels=16 --seconds=10 \
      | tee "$OUT/throughput_256.json"
    check "throughput N=256 x 64" "${PIPESTATUS[0]}"
    echo "== small calls: N=16, 8 callers; then one caller"
    load_phase gpu --rows=16 --callers=8 --channels=8 --seconds=5 | tee "$OUT/latency_16.json"
    check "latency N=16 x 8" "${PIPESTATUS[0]}"
    load_phase gpu --rows=16 --callers=1 --channels=1 --seconds=3 | tail -2
    check "latency N=16 x 1" "${PIPESTATUS[0]}"
    load_phase gpu --rows=1 --callers=1 --channels=1 --seconds=3 | tail -2
    check "latency N=1 x 1" "${PIPESTATUS[0]}"
    scrape "$gpu_metrics" > "$OUT/metrics.txt"
    echo "== projection from the GPU, then from the CPU (same seeded rows)"
    "$bin/detlogp_cli" project --target="$gpu_target" --project_rows=37296 --seed=7 \
      | tee "$OUT/project_gpu.txt"
    check "projection from the GPU" "${PIPESTATUS[0]}"
    stop_server gpu
    start_server cpu --device=cpu || return
    "$bin/detlogp_cli" project --target="$cpu_target" --project_rows=37296 --seed=7 \
      | tee "$OUT/project_cpu.txt"
    check "projection from the CPU" "${PIPESTATUS[0]}"
    stop_server cpu
    # The first two lines: the determinism key and Y's digest.
    [[ -s $OUT/project_gpu.txt ]] &&
      cmp -s <(head -2 "$OUT/project_gpu.txt") <(head -2 "$OUT/project_cpu.txt")
    check "projection: GPU == CPU bits (same digest, same key)" $?
  fi
  if [[ -n ${SWEEP:-} ]]; then
    # Each entry threads:delay_us:rows[:spin_us[:qos]]; "qos" holds
    # /dev/cpu_dma_latency at 0 (no deep CPU sleep states) meanwhile.
    # SWEEP_LARGE=0 skips the N=256 load.
    local config threads delay rows spin qos qos_holder
    for config in $SWEEP; do
      IFS=: read -r threads delay rows spin qos <<< "$config"
      qos_holder=""
      if [[ $qos == qos ]]; then
        python3 -c 'import os, struct, time
fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY); os.write(fd, struct.pack("i", 0)); time.sleep(3600)' &
        qos_holder=$!
      fi
      echo "-- batch_threads=$threads max_queue_delay_us=$delay max_batch_rows=$rows batch_spin_us=${spin:--1} ${qos:+cpu_dma_latency=0}"
      start_server sweep --device=cuda:0 "${synthetic_model[@]}" --batch_threads="$threads" \
        --max_queue_delay_us="$delay" --max_batch_rows="$rows" --max_queue_rows=262144 \
        --batch_spin_us="${spin:--1}" || continue
      if [[ ${SWEEP_LARGE:-1} != 0 ]]; then
        load_phase sweep --rows=256 --callers=64 --channels=16 --seconds=8 --warmup_seconds=2 | tail -2
      fi
      load_phase sweep --rows=16 --callers=8 --channels=8 --seconds=4 --warmup_seconds=1 | tail -2
      load_phase sweep --rows=16 --callers=1 --channels=1 --seconds=3 --warmup_seconds=1 | tail -2
      stop_server sweep
      [[ -n $qos_holder ]] && kill "$qos_holder"
    done
  fi
  echo "== the kernel alone at the same batch sizes (no transport)"
  python3 "$scripts/logp_bench.py" --lib "$bundle/lib/liblogp_bench.so" \
    --ns 16,256,2048,4096 --reps 20 --no-torch 2>&1 | tail -8
  check "logp_bench.py, kernel only" "${PIPESTATUS[0]}"
  local gpus
  gpus=$(nvidia-smi -L | grep -c "^GPU ")
  if [[ $gpus -ge 2 && ${MULTI_GPU:-1} != 0 ]]; then
    serve_multi_gpu
  fi
}

# The same rows on GPU 0, on GPU 1, on both with replicated weights
# (cuda:all) and on both with the vocabulary split between them
# (--vocab_parallel): identical bits under one determinism key. Then
# throughput of each, and new versions uploaded while 64 callers score.
serve_multi_gpu() {
  export NCCL_NVLS_ENABLE=0
  local model=("${synthetic_model[@]}" --max_queue_rows=262144 --max_batch_rows=4096
    --max_queue_delay_us=0)
  score() { # $1 = target: 512 seeded random rows, printed exactly
    "$bin/detlogp_cli" score --target="$1" --random_rows=512 --seed=42 --return_lse
  }
  same() { # $1 $2 = score files, $3 = what
    cmp -s "$1" "$2"
    check "$3: identical bits and key" $?
  }
  swap() { # $1 = target: a new 1.24 GB version every 2 s for 8 s under load
    "$bin/swap_under_load" --target="$1" --callers=64 --channels=16 --rows=256 \
      --steady_seconds=3 --swap_seconds=8 --swap_every_seconds=2
    check "versions uploaded under load ($2)" $?
  }
  throughput() { # $1 = target
    "$bin/serve_throughput" --target="$1" --rows=256 --callers=64 --channels=16 \
      --seconds=6 --warmup_seconds=2 | tail -1
  }
  echo "== two GPUs: one each"
  start_server gpu0 --device=cuda:0 "${model[@]}" || return
  start_server gpu1 --device=cuda:1 "${model[@]}" || return
  score "$gpu0_target" > "$OUT/score_gpu0.txt"
  score "$gpu1_target" > "$OUT/score_gpu1.txt"
  same "$OUT/score_gpu0.txt" "$OUT/score_gpu1.txt" "GPU 1 vs GPU 0"
  echo "== one GPU, N=256 x 64 callers"
  throughput "$gpu0_target"
  stop_server gpu0
  stop_server gpu1
  echo "== cuda:all (replicated)"
  start_server all --device=cuda:all --max_versions_per_model=16 "${model[@]}" || return
  score "$all_target" > "$OUT/score_all.txt"
  same "$OUT/score_gpu0.txt" "$OUT/score_all.txt" "cuda:all (replicated) vs GPU 0"
  "$bin/detlogp_cli" check-invariance --target="$all_target" --probes=16 \
    --concurrency=32 --calls_per_thread=4 --channels=8
  check "invariance, cuda:all" $?
  throughput "$all_target"
  swap "$all_target" "cuda:all"
  stop_server all
  echo "== vocabulary-parallel"
  start_server vocab --device=cuda:all --vocab_parallel --max_versions_per_model=16 \
    "${model[@]}" || return
  score "$vocab_target" > "$OUT/score_vocab.txt"
  same "$OUT/score_gpu0.txt" "$OUT/score_vocab.txt" "vocabulary-parallel (2 GPUs) vs GPU 0"
  "$bin/detlogp_cli" check-invariance --target="$vocab_target" --probes=16 \
    --concurrency=32 --calls_per_thread=4 --channels=8
  check "invariance, vocabulary-parallel" $?
  throughput "$vocab_target"
  swap "$vocab_target" "vocabulary-parallel"
  stop_server vocab
}

suite_live_weights() {
  python_env
  local model=(--device=cuda:0 "${synthetic_model[@]}" --max_batch_rows=4096
    --max_queue_delay_us=0 --max_queue_rows=262144)
  # Two cases need a request that outlasts an UnloadModel call or a
  # publish; the GPU answers theirs first, so they stay with the CPU
  # servers of CI.
  echo "== live-weights tests against a server on cuda:0"
  DETLOGP_TEST_DEVICE=cuda:0 run_gtest live_weights_test 900 \
    --gtest_filter='-*UnloadWaitsForTheVersionsRequests*:*MultiSliceRequestNeverMixesVersions*'
  echo "== versions kept (no --model_root)"
  start_server a "${model[@]}" --max_versions_per_model=64 || return
  "$bin/detlogp_cli" check-invariance --target="$a_target" --probes=32 \
    --concurrency=64 --calls_per_thread=4 --channels=8 | tail -3
  check "invariance" "${PIPESTATUS[0]}"
  echo "== one model: N=256 x 64 callers"
  "$bin/serve_throughput" --target="$a_target" --rows=256 --callers=64 --channels=16 \
    --seconds=10 | tail -1 | tee "$OUT/one_model.txt"
  check "one model throughput" "${PIPESTATUS[0]}"
  echo "== swap under load: a new version every 2 s, every answer checked"
  "$bin/swap_under_load" --target="$a_target" --model=policy --callers=64 --channels=16 \
    --rows=256 --steady_seconds="${STEADY_SECONDS:-10}" --swap_seconds="${SWAP_SECONDS:-60}" \
    --swap_every_seconds=2 | tee "$OUT/swap.json"
  check "swap under load" "${PIPESTATUS[0]}"
  echo "== two models alternating (default, policy): N=256 x 64 callers"
  "$bin/serve_throughput" --target="$a_target" --rows=256 --callers=64 --channels=16 \
    --seconds=10 --models=default,policy | tail -1 | tee "$OUT/two_models.txt"
  check "two models throughput" "${PIPESTATUS[0]}"
  local one two
  one=$(awk '{print $3}' "$OUT/one_model.txt")
  two=$(awk '{print $3}' "$OUT/two_models.txt")
  python3 -c "one, two = float('${one:-0}'), float('${two:-0}'); print(f'two models / one model rows/s: {two / one:.3f}' if one > 0 else 'no one-model figure')"
  stop_server a
  echo "== --model_root, 2 versions kept"
  local root=$work/model_root
  mkdir -p "$root"
  start_server b "${model[@]}" --model_root="$root" || return
  if python3 -c "import grpc, google.protobuf" 2> /dev/null; then
    python3 "$scripts/live_weights_bench.py" --target="$b_target" --model_root="$root" \
      --repeats=3 2>&1 | tee "$OUT/upload.txt"
    check "live_weights_bench.py (upload and load times)" "${PIPESTATUS[0]}"
  else
    echo "no grpcio/protobuf for python3 (put their wheels in .whl): upload times left out"
  fi
  "$bin/swap_under_load" --target="$b_target" --model=policy --callers=64 --channels=16 \
    --rows=256 --steady_seconds=5 --swap_seconds=20 --swap_every_seconds=2 \
    --solo_check=false | tee "$OUT/swap_persisted.json"
  check "swap under load, versions persisted" "${PIPESTATUS[0]}"
  "$bin/detlogp_cli" info --target="$b_target" --model=policy > "$work/before.txt" 2>&1
  stop_server b
  du -sh "$root"/* 2> /dev/null
  echo "== restart on the same --model_root"
  start_server c "${model[@]}" --model_root="$root" || return
  grep -E "restored|model policy|model reference" "$OUT/server_c.log" | head -5
  "$bin/detlogp_cli" info --target="$c_target" --model=policy > "$work/after.txt" 2>&1
  local fields="model_version|determinism_key|weights_sha256"
  grep -qE "$fields" "$work/before.txt" &&
    diff <(grep -E "$fields" "$work/before.txt") <(grep -E "$fields" "$work/after.txt")
  check "restart: same version, digest and key" $?
  stop_server c
}

suite_projection() {
  echo "== GPU tests"
  run_gtest projection_cuda_test 300
  run_gtest projection_backend_cuda_test 300
  if command -v cuobjdump > /dev/null; then
    # The forward and dX loops are FFMA chains: no FMUL/FADD splitting an
    # fma, no local memory in the hot kernels.
    cuobjdump --dump-sass "$bin/projection_bench" 2> /dev/null | awk '
      /Function : / { f = $3 }
      /FFMA|FMUL|FADD|LDL|STL/ {
        for (i = 1; i <= NF; i++) if ($i ~ /^(FFMA|FMUL|FADD|LDL|STL)/) {
          split($i, a, "."); c[f " " a[1]]++; break
        }
      }
      END { for (k in c) print "  SASS", k, c[k] }' | sort
  fi
  local rows=${ROWS:-1,128,1024,4096,13104,37296,72576,102816,108576,364608}
  echo "== the kernels, then PyTorch in the same run"
  timeout 300 "$bin/projection_bench" --rows="$rows" --reps=25 --json="$OUT/ours.json" \
    2>&1 | tee "$OUT/bench.log"
  check "projection_bench" "${PIPESTATUS[0]}"
  timeout 300 python3 "$scripts/projection_bench.py" --ours "$OUT/ours.json" --rows="$rows" \
    --json "$OUT/bench.json" --md "$OUT/table.md" 2>&1 | tee -a "$OUT/bench.log"
  check "projection_bench.py" "${PIPESTATUS[0]}"
  if [[ ${NCU:-0} == 1 ]]; then
    # Where the forward's time goes (no clock control: the card as found).
    local kernel
    for kernel in ProjectionForwardKernel ProjectionForwardWideKernel; do
      timeout 120 ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 3 \
        --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section Occupancy \
        "$bin/projection_bench" --rows=102816 --reps=20 > "$OUT/ncu_$kernel.txt" 2>&1
      check "ncu $kernel" $?
      grep -iE "SM Frequency|Duration|Compute \(SM\) Throughput|Issue Slots Busy|FMA|stall|Warp Cycles Per Issued|Achieved Occupancy|Registers" \
        "$OUT/ncu_$kernel.txt" | head -40
    done
  fi
}

# Knobs: CHUNKS ("256 512 1024 2048"; "512:u" connects over the Unix
# socket), ROWS (364608), REPEATS (1 timed round per setting), CALLS ("1
# 4"), WARMUP_ROUNDS (1), FOUR_CHUNK (512), FOUR_VIDEOS=0, FOUR_TARGET=unix,
# TRANSPORT_BENCH=0, TRANSPORT_UNIX=1, SERVER_ARGS.
suite_projection_stream() {
  local rows=${ROWS:-364608} four_chunk=${FOUR_CHUNK:-512}
  local socket=$work/detlogp.sock
  read -r -a server_args <<< "${SERVER_ARGS:-}"
  start_server p --device=cuda:0 --unix_socket="$socket" "${server_args[@]}" || return
  local tcp_target=$p_target cli_target=$p_target
  # The CLI tuned for large messages, as the published figures were taken.
  cli() {
    "$bin/detlogp_cli" project --project_malloc_tuning --target="$cli_target" \
      --project_rows="$rows" "$@"
  }
  timed() { # where the server's time went during one command
    scrape "$p_metrics" > "$work/m_before.txt"
    local start=$EPOCHREALTIME
    "$@"
    local rc=$? end=$EPOCHREALTIME
    scrape "$p_metrics" > "$work/m_after.txt"
    python3 "$scripts/metrics_delta.py" "$work/m_before.txt" "$work/m_after.txt" \
      "$(python3 -c "print($end - $start)")" | grep "^projection"
    return $rc
  }
  nproc
  grep -m1 "model name" /proc/cpuinfo
  cli --rows_per_chunk=512 --nohash_y --seed=1 > /dev/null
  check "warm-up projection" $?
  # Rounds go over every setting in turn, ascending in odd rounds and
  # descending in even ones, so that a slow spell of the host hits every
  # setting alike and no size always runs last; untimed warm-up rounds first
  # (a size's first run pins its chunk buffers).
  local chunks rep pos positions chunk suffix streams speed
  read -r -a chunks <<< "${CHUNKS:-256 512 1024 2048}"
  rm -f "$work"/speed_*.txt
  for rep in $(seq $((1 - ${WARMUP_ROUNDS:-1})) "${REPEATS:-1}"); do
    positions=$(seq 0 $((${#chunks[@]} - 1)))
    ((rep % 2)) || positions=$(tac <<< "$positions")
    for pos in $positions; do
      chunk=${chunks[$pos]%%:*}
      suffix=
      [[ ${chunks[$pos]} == *:* ]] && suffix=${chunks[$pos]#*:}
      cli_target=$tcp_target
      [[ $suffix == *u* ]] && cli_target=unix:$socket
      for streams in ${CALLS:-1 4}; do
        if ((rep < 1)); then
          cli --rows_per_chunk="$chunk" --project_streams="$streams" --seed=7 --nohash_y \
            | grep -E "^transfer"
          continue
        fi
        echo "-- one projection, rows_per_chunk=$chunk, $streams call(s), no hashing (round $rep, $cli_target)"
        timed cli --rows_per_chunk="$chunk" --project_streams="$streams" --seed=7 --nohash_y \
          | grep -E "^transfer|^client|^projection" | tee "$work/run.txt"
        check "stream rows_per_chunk=$chunk calls=$streams round $rep" "${PIPESTATUS[0]}"
        # A failed run leaves "nan", so that the files stay aligned by round.
        speed=$(awk '/^transfer/ { print $5 }' "$work/run.txt")
        echo "${speed:-nan}" >> "$work/speed_${pos}_${streams}.txt"
      done
    done
  done
  for streams in ${CALLS:-1 4}; do
    python3 "$scripts/projection_stream_summary.py" --calls="$streams" \
      --chunks="${chunks[*]}" "$work/speed_%d_$streams.txt"
  done
  cli_target=$tcp_target
  [[ ${FOUR_TARGET:-tcp} == unix ]] && cli_target=unix:$socket
  if [[ ${FOUR_VIDEOS:-1} != 0 ]]; then
    echo "-- one projection, rows_per_chunk=$four_chunk, SHA-256 on its own thread"
    cli --rows_per_chunk="$four_chunk" --seed=7 | grep -E "y_sha256|transfer|sha256 seconds"
    check "hashed projection" "${PIPESTATUS[0]}"
    local mode hash calls i pids peak rss rc
    for mode in "--nohash_y 1" "--hash_y 1" "--nohash_y 4"; do
      read -r hash calls <<< "$mode"
      echo "-- four videos at once, rows_per_chunk=$four_chunk, $calls call(s) each, $hash"
      pids=()
      for i in 1 2 3 4; do
        cli --rows_per_chunk="$four_chunk" --project_streams="$calls" --seed=$i "$hash" \
          > "$work/four_$i.txt" &
        pids+=($!)
      done
      peak=0
      while kill -0 "${pids[@]}" 2> /dev/null; do
        rss=$(awk '/VmRSS/ {print $2}' "/proc/$p_pid/status")
        ((rss > peak)) && peak=$rss
        sleep 0.1
      done
      rc=0
      for i in "${pids[@]}"; do wait "$i" || rc=1; done
      check "four videos at once ($calls call(s) each, $hash)" $rc
      grep -h "^transfer" "$work"/four_*.txt | awk -v r="$rows" \
        '{ if ($3 > m) m = $3 } END { printf "four streams: slowest %.3f s, %.2f GB/s in total\n", m, 4 * r * 5376 * 4 / m / 1e9 }'
      echo "server peak RSS during the four streams: $((peak / 1024)) MiB"
    done
  fi
  stop_server p
  if [[ ${TRANSPORT_BENCH:-1} != 0 ]]; then
    # The stream's transport without compute (an instant backend), on this
    # host's cores, each setting in a fresh process.
    local sockets bench_socket
    for chunk in $(tr ' ' '\n' <<< "${chunks[*]%%:*}" | sort -nu); do
      for calls in ${BENCH_CALLS:-1 2 4}; do
        sockets=("")
        [[ ${TRANSPORT_UNIX:-0} != 0 ]] && sockets+=("$work/bench.sock")
        for bench_socket in "${sockets[@]}"; do
          echo "-- transport-only, one projection, rows_per_chunk=$chunk, $calls call(s), ${bench_socket:-loopback TCP}"
          "$bin/projection_stream" --reader=client --rows="$rows" --chunks="$chunk" --streams=0 \
            --repeats=3 --client_streams="$calls" --unix_socket="$bench_socket" \
            | grep -A1 "stream(s)"
          check "transport-only rows_per_chunk=$chunk calls=$calls" "${PIPESTATUS[0]}"
        done
      done
    done
    echo "-- transport-only, four projections of one call, rows_per_chunk=2048"
    "$bin/projection_stream" --reader=client --rows="$rows" --chunks= --streams=4 \
      --concurrent_chunks=2048 --repeats=3 | grep -A1 "stream(s)"
    check "transport-only, four projections" "${PIPESTATUS[0]}"
  fi
}

# run_pytest LOG ARGS...: pytest ARGS (within 600 s), its output in
# $OUT/LOG; prints the failures and checks its exit code.
run_pytest() {
  local log=$OUT/$1
  shift
  timeout 600 python3 -m pytest -p no:cacheprovider -o addopts="" "$@" > "$log" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR)" "$log" | head -20
  check "pytest: $(tail -1 "$log")" $rc
}

# The client's GPU cases (CUDA regions, the C++ client given CUDA tensors).
suite_rollout_pytest() {
  echo "== pytest: the client's shared-memory and C++-client cases on the GPU"
  run_pytest pytest.log -q -rs "$bundle/python/client/tests/test_shared_memory.py" \
    "$bundle/python/client/tests/test_native_transport.py"
  ! grep -qE "SKIPPED.*no CUDA device" "$OUT/pytest.log"
  check "pytest: the CUDA cases ran" $?
}

suite_rollout() {
  python_env
  if [[ ${PYTEST:-1} == 1 ]]; then suite_rollout_pytest; fi
  timeout 560 python3 "$scripts/rollout_worker_bench.py" --server="$bin/detlogp_server" \
    --json_out="$OUT/rollout.json" "$@" 2>&1 | tee "$OUT/rollout.log"
  check "rollout_worker_bench.py (bits on every path)" "${PIPESTATUS[0]}"
}

suite_twin() {
  python_env
  python3 -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "grpcio", grpc.__version__, "protobuf", p.__version__)'
  echo "== pytest: detlogp.torch"
  # Less the case that compares with a CPU server: the server here picks
  # the GPU (CI runs it).
  run_pytest pytest.log -v -k "not cpu_bits_equal_the_cpu_server" \
    "$bundle/python/client/tests/test_torch_ops.py"
  ! grep -q "test_cuda_forward_is_batch_invariant_and_backward_runs SKIPPED" "$OUT/pytest.log"
  check "pytest: the CUDA case ran" $?
  echo "== pytest: detlogp.torch under torch.compile and CUDA graphs"
  run_pytest pytest_compile.log -v "$bundle/python/client/tests/test_torch_compile.py"
  ! grep -E "test_(cuda_graph|reduce_overhead|opcheck_the_fused)[a-z_]* SKIPPED" \
    "$OUT/pytest_compile.log"
  check "pytest compile/graphs: no CUDA case skipped" $?
  echo "== twin_check.py"
  python3 "$scripts/twin_check.py" --server="$DETLOGP_SERVER" "$@" 2>&1 | tee "$OUT/twin_check.log"
  local rc=${PIPESTATUS[0]}
  passed=$((passed + $(grep -c "^PASS" "$OUT/twin_check.log")))
  failed=$((failed + $(grep -c "^FAIL" "$OUT/twin_check.log")))
  [[ $rc -ne 0 ]] && ! grep -q "^FAIL" "$OUT/twin_check.log" && fail "twin_check.py: exit code $rc"
  echo "== examples/grpo_twin_step.py against a GPU server"
  # A random bf16 lm_head (H=4096, V=151936, with a bias) in safetensors.
  local weights=$work/lm_head.safetensors
  python3 - "$weights" << 'PY'
import sys

import ml_dtypes
import numpy as np
from detlogp import safetensors_io

rng = np.random.default_rng()
w = (rng.standard_normal((151936, 4096), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
b = rng.standard_normal(151936, dtype=np.float32) * 0.1
safetensors_io.write(sys.argv[1], {"lm_head.weight": w, "lm_head.bias": b})
PY
  check "random lm_head written" $? || return
  start_server grpo --device=cuda:0 --weights="$weights" --bias_tensor=lm_head.bias || return
  python3 "$scripts/grpo_twin_step.py" --target "$grpo_target" --weights "$weights" \
    --bias_tensor lm_head.bias 2>&1 | tee "$OUT/grpo.log"
  check "grpo_twin_step.py" "${PIPESTATUS[0]}"
  stop_server grpo
}

suite_backward() {
  echo "== wgmma with MN-major operands, then the backward's GPU tests"
  run_gtest wgmma_mn_major_test 60
  run_gtest linear_logp_backward_test "${BACKWARD_TIMEOUT:-240}"
  if [[ $failed -ne 0 && ${BENCH:-0} != 1 ]]; then
    echo "tests failed: bench left out (BENCH=1 runs it anyway)"
    return
  fi
  python_env
  echo "== forward + backward beside PyTorch eager and Liger"
  timeout "${BENCH_TIMEOUT:-300}" python3 "$scripts/logp_backward_bench.py" \
    --sizes "${SIZES:-1024,4096,8192,16384}" "$@" 2>&1 | tee "$OUT/backward_bench.log"
  check "logp_backward_bench.py" "${PIPESTATUS[0]}"
  echo "== detlogp.torch forward + backward beside eager and torch.compile"
  timeout "${BENCH_TIMEOUT:-300}" python3 "$scripts/twin_train_bench.py" \
    --sizes "${SIZES:-1024,4096,8192,16384}" 2>&1 | tee "$OUT/twin_train_bench.log"
  check "twin_train_bench.py" "${PIPESTATUS[0]}"
  passed=$((passed + $(grep -c "^PASS" "$OUT/twin_train_bench.log")))
  failed=$((failed + $(grep -c "^FAIL" "$OUT/twin_train_bench.log")))
}

"suite_${suite//-/_}" "$@"
finish
