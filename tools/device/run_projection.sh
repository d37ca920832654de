#!/usr/bin/env bash
# Runs on the device machine (tools/device/build_projection.sh builds the
# inputs here first; carry .device/projection): the CPU and GPU tests, then
# our kernel timings and the same-run PyTorch baseline. Usage:
#   run_projection.sh [test|bench|all] [--rows=...]
# Logs go to $OUT (or .device/projection/out when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE="${1:-all}"
ROWS="${2:---rows=1,128,1024,4096,13104,37296,72576,102816,108576,364608}"
ROWS="${ROWS#--rows=}"
LOG="${OUT:-.device/projection/out}"
mkdir -p "$LOG"
D=.device/projection
export LD_LIBRARY_PATH="$PWD/$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$LOG/gpu.txt"
rc=0
if [ "$MODE" = test ] || [ "$MODE" = all ]; then
  timeout 200 "$D/projection_test" 2>&1 | tee "$LOG/tests.log" | grep -E '^\[  (PASSED|FAILED)|Failure|FAILED' ; rc=${PIPESTATUS[0]}
  timeout 200 "$D/projection_cuda_test" 2>&1 | tee -a "$LOG/tests.log" | grep -vE '^\[       OK|^\[ RUN' ; grc=${PIPESTATUS[0]}
  echo "test exit codes: cpu $rc gpu $grc"
  [ $rc -eq 0 ] && rc=$grc
fi
if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  timeout 200 "$D/projection_bench" --rows="$ROWS" --reps=25 --json="$LOG/ours.json" 2>&1 | tee "$LOG/bench.log"
  PYTHONUNBUFFERED=1 timeout 200 python3 tools/device/projection_bench.py \
    --ours "$LOG/ours.json" --rows="$ROWS" --json "$LOG/bench.json" --md "$LOG/table.md" 2>&1 | tee -a "$LOG/bench.log"
  brc=${PIPESTATUS[0]}
  echo "bench exit code: $brc"
  [ $rc -eq 0 ] && rc=$brc
fi
if [ "$MODE" = ncu ] || { [ "$MODE" = all ] && [ "${NCU:-0}" = 1 ]; }; then
  # Where the forward's time goes (no clock control: leave the card as found).
  for k in 'ProjectionForwardKernel' 'ProjectionForwardWideKernel'; do
    timeout 120 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 3 \
      --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section Occupancy \
      "$D/projection_bench" --rows=102816 --reps=20 > "$LOG/ncu_$k.txt" 2>&1
    grep -iE "SM Frequency|Duration|Compute \(SM\) Throughput|Issue Slots Busy|FMA|stall|Warp Cycles Per Issued|Achieved Occupancy|Registers" "$LOG/ncu_$k.txt" | head -40
  done
fi
exit $rc
