#!/usr/bin/env bash
# Runs on the device machine: logp_extras_bench.py over several bench
# libraries (build_logp.sh / build_logp_variant.sh) in one call, in rounds
# whose order alternates (a b c, then c b a, ...), so that two builds are
# compared at the same clocks and temperature: in interleaved timing a
# kernel starts at the clock the one before it left (docs/perf.md, "Top-k,
# session 16"), so compare libraries within a call, and the same seed's
# digests across them (the extras' bits must not change).
#   LIBS="a.so b.so" ROUNDS=2 NS=1024,2048,4096 KERNEL=hopper \
#     bash tools/device/ab_logp_extras.sh
# LIBDIR: the folder with the libraries they load (default: the first
# library's folder's lib). Ends with tools/device/ab_summary.py's medians
# (each library against the first); LOG keeps the rounds' lines.
# BENCH_TIMEOUT (seconds, default 300) ends a library's run that hangs.
set -uo pipefail
cd "$(dirname "$0")/../.."
read -r -a libs <<< "${LIBS:?set LIBS to bench libraries}"
LIBDIR=${LIBDIR:-$(dirname "${libs[0]}")/lib}
export LD_LIBRARY_PATH="$PWD/$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log=${LOG:-}
if [[ -z $log ]]; then log=$(mktemp); trap 'rm -f "$log"' EXIT; fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  order=("${libs[@]}")
  if (( round % 2 == 0 )); then
    order=()
    for (( i = ${#libs[@]} - 1; i >= 0; --i )); do order+=("${libs[i]}"); done
  fi
  for lib in "${order[@]}"; do
    echo "== round $round $lib"
    timeout "${BENCH_TIMEOUT:-300}" python3 tools/device/logp_extras_bench.py --lib "$lib" \
      --kernel "${KERNEL:-hopper}" --seed 8 --ns "${NS:-1024,2048,4096}" \
      --reps "${REPS:-21}" --no-torch ${EXTRA:-} 2>&1 |
      grep -E "^N=|FAIL|PASS|^ +[0-9]+ "
  done
done | tee "$log"
python3 tools/device/ab_summary.py "$log"
