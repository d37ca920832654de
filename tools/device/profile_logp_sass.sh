#!/usr/bin/env bash
# Runs on the device machine: a per-instruction ncu profile (warp-stall
# samples and instructions executed per SASS instruction) of one launch of
# the Hopper split kernel, for the logp-only variant and the top-20 one, at
# one N, from logp_extras_bench.py with a bench library
# (tools/device/build_logp.sh or build_logp_variant.sh). Writes
# $OUT/<tag>_<variant>_sass.csv (ncu's source page) and _raw.csv (every
# metric) for tools/device/sass_profile_summary.py to read here; the .ncu-rep
# files stay on the device (too big to bring back).
#   LIB=.device/logp/liblogp_bench.so N=1024 TAG=head \
#     bash tools/device/profile_logp_sass.sh
# Carry the library's folder and its lib/ (LIBDIR, default its folder's
# lib). ncu needs --clock-control none here (METHOD.md: leave the clocks).
set -uo pipefail
cd "$(dirname "$0")/../.."
LIB=${LIB:?set LIB to a bench library}
N=${N:-1024}
TAG=${TAG:-profile}
LIBDIR=${LIBDIR:-$(dirname "$LIB")/lib}
OUT=${OUT:-.device/profile}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
work=$(mktemp -d)
# <kEntropy, kTopK>: the logp-only kernel and the top-k one.
for variant in logp:0 top20:1; do
  name=${variant%%:*}
  topk=${variant##*:}
  rep="$work/${TAG}_$name"
  timeout 240 ncu --clock-control none --kernel-name-base demangled \
    --kernel-name "regex:LinearLogpSplitKernel<.bool.0, .bool.$topk>" \
    --launch-skip 1 --launch-count 1 \
    --section SourceCounters --section WarpStateStats -o "$rep" -f \
    python3 tools/device/logp_extras_bench.py --lib "$LIB" --kernel hopper \
      --seed 8 --ns "$N" --reps 3 --no-torch > "$rep.log" 2>&1
  grep -E "^N=|FAIL" "$rep.log"
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/${TAG}_${name}_sass.csv"
  ncu -i "$rep.ncu-rep" --page raw --csv > "$OUT/${TAG}_${name}_raw.csv"
done
rm -rf "$work"
ls -la "$OUT"
