#!/usr/bin/env bash
# Runs on the device machine: each kernel of a linear-logp launch timed on
# its own (ncu's gpu__time_duration, one metric, one pass per kernel), from
# logp_extras_bench.py with a bench library, e.g. what the combine kernels
# cost beside the split kernel (docs/perf.md, "Top-k, session 18"). Prints
# the median per kernel and grid (tools/device/kernel_durations_summary.py)
# and leaves ncu's CSV in $OUT/<tag>_n<N>_durations.csv (the benchmark's own
# lines, with its outputs' digest, come first).
#   LIB=.device/logp/liblogp_bench.so NS=1024,4096 TAG=head \
#     bash tools/device/kernel_durations.sh
# KERNELS: ncu's --kernel-name filter (default: the split and combine
# kernels, not the benchmark's float64 references).
# ncu serialises the kernels: read each one's duration, not their sum.
set -uo pipefail
cd "$(dirname "$0")/../.."
LIB=${LIB:?set LIB to a bench library}
TAG=${TAG:-$(basename "$LIB" .so)}
OUT=${OUT:-.device/profile}
mkdir -p "$OUT"
LIBDIR=${LIBDIR:-$(dirname "$LIB")/lib}
export LD_LIBRARY_PATH="$PWD/$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# One profiled run per N: the persistent split kernel's grid is the SM
# count at every N, so only the run tells its launches apart.
IFS=, read -r -a ns <<< "${NS:-1024,4096}"
for n in "${ns[@]}"; do
  csv="$OUT/${TAG}_n${n}_durations.csv"
  timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum \
    --kernel-name "${KERNELS:-regex:LinearLogp|Combine}" --csv --page raw \
    python3 tools/device/logp_extras_bench.py --lib "$LIB" \
      --kernel "${KERNEL:-hopper}" --seed 8 --ns "$n" --reps 3 \
      --no-torch > "$csv" 2> "$OUT/${TAG}_n${n}_durations.log"
  echo "== $TAG N=$n"
  grep -E "^N=" "$csv" | sed 's/torch eager nan ms; //'
  python3 tools/device/kernel_durations_summary.py "$csv"
done
