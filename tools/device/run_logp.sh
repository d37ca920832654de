#!/usr/bin/env bash
# Runs on the device machine (tools/device/build_logp.sh builds the inputs
# here first; carry .device/logp). Usage: run_logp.sh [test|bench|all] [args
# for logp_bench.py]. Logs go to $OUT (or .device/logp/out when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE="${1:-all}"
shift || true
LOG="${OUT:-.device/logp/out}"
mkdir -p "$LOG"
export LD_LIBRARY_PATH="$PWD/.device/logp/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$LOG/gpu.txt"
if command -v cuobjdump >/dev/null; then
  echo "HGMMA in SASS: $(cuobjdump --dump-sass .device/logp/linear_logp_cuda.o | grep -c HGMMA)"
fi
rc=0
if [ "$MODE" = test ] || [ "$MODE" = all ]; then
  timeout 400 .device/logp/linear_logp_cuda_test 2>&1 | tee "$LOG/test.log" | grep -vE '^\[       OK|^\[ RUN' ; rc=${PIPESTATUS[0]}
  echo "test exit code: $rc"
fi
if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  PYTHONUNBUFFERED=1 timeout 400 python3 tools/device/logp_bench.py \
    --lib .device/logp/liblogp_bench.so --json "$LOG/bench.json" "$@" 2>&1 | tee "$LOG/bench.log"
  brc=${PIPESTATUS[0]}
  echo "bench exit code: $brc"
  [ $rc -eq 0 ] && rc=$brc
fi
exit $rc
