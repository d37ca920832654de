#!/usr/bin/env bash
# Runs on the device machine (tools/device/build_portable.sh builds the
# inputs here first; carry .device/portable). Usage:
# run_portable.sh [test|sanitize|all] [gtest args]. Logs go to $OUT (or
# .device/portable/out when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE="${1:-all}"
shift || true
LOG="${OUT:-.device/portable/out}"
mkdir -p "$LOG"
export LD_LIBRARY_PATH="$PWD/.device/portable/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$LOG/gpu.txt"
rc=0
if [ "$MODE" = sanitize ] || [ "$MODE" = all ]; then
  # memcheck + racecheck-free first look on the small shapes (first: an
  # out-of-bounds cp.async or a bad ldmatrix address shows up here).
  if command -v compute-sanitizer >/dev/null; then
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 \
      .device/portable/linear_logp_portable_test \
      --gtest_filter='LinearLogpPortableVersion.*:Edges/PortableShapeTest.*/V1_*:Edges/PortableShapeTest.*/V63_*:Edges/PortableShapeTest.*/V65_*H64*:LinearLogpPortableInputs.*:LinearLogpPortableExtras.RejectsBadTopK:LinearLogpPortableExtras.SmallVocabulariesAndPadding' \
      > "$LOG/sanitize.log" 2>&1
    src=$?
    tail -n 6 "$LOG/sanitize.log"
    echo "compute-sanitizer exit code: $src"
    rc=$src
  else
    echo "compute-sanitizer not found: skipped"
  fi
fi
if [ "$MODE" = test ] || [ "$MODE" = all ]; then
  timeout 360 .device/portable/linear_logp_portable_test "$@" 2>&1 | tee "$LOG/test.log" | grep -vE '^\[       OK|^\[ RUN'
  trc=${PIPESTATUS[0]}
  echo "test exit code: $trc"
  [ $trc -eq 124 ] && echo "tests timed out (hang?)"
  # On the device machine nothing may be skipped (skips mean no sm_90 GPU).
  if grep -q '^\[  SKIPPED \]' "$LOG/test.log"; then
    echo "tests were SKIPPED on the device machine"; [ $trc -eq 0 ] && trc=5
  fi
  [ $rc -eq 0 ] && rc=$trc
fi
exit $rc
