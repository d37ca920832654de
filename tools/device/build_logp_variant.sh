#!/usr/bin/env bash
# Builds one experimental variant of the kernels into its own bench library,
# .device/logp/liblogp_bench_NAME.so, next to build_logp.sh's (run that
# first: this links its other objects). Variants differ by preprocessor
# flags the working tree's kernels read (an experiment's #if, never
# committed); the portable kernel is built for sm_90 only, the Hopper
# kernel (linear_logp_cuda.cu) is rebuilt only with --hopper. Then time them
# all in one device call, e.g.
#   for v in "" _a _b; do python3 tools/device/logp_portable_bench.py \
#     --lib .device/logp/liblogp_bench$v.so --ns 2048,4096,8192 --reps 15; done
# (session 10 timed four tilings at three N in ~40 s this way).
# --at COMMIT builds the kernels as they are at COMMIT (a temporary git
# worktree) instead of the working tree's, e.g. a session's baseline:
#   tools/device/build_logp_variant.sh base --at c39a9d6 --hopper
# (the bench library's C API, logp_bench_lib.o, comes from the working tree).
# --patch FILE applies FILE (tools/device/experiments/) to that worktree
# first, at HEAD unless --at names a commit; the working tree is untouched:
#   tools/device/build_logp_variant.sh ppm --patch \
#     tools/device/experiments/pingpong_multicast.patch --hopper -DDETLOGP_PINGPONG=1
#   tools/device/build_logp_variant.sh NAME [--at COMMIT] [--patch FILE] [--hopper] [NVCC FLAGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/device/common.sh
usage="usage: build_logp_variant.sh NAME [--at COMMIT] [--patch FILE] [--hopper] [NVCC FLAGS...]"
name=${1:?$usage}
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
src=.
at=""
patch=""
while [[ ${1:-} == --at || ${1:-} == --patch ]]; do
  if [[ $1 == --at ]]; then at=${2:?--at needs a commit}; else patch=$(realpath "${2:?--patch needs a file}"); fi
  shift 2
done
if [[ -n $at || -n $patch ]]; then
  src=$dir/src
  git worktree add --detach "$src" "${at:-HEAD}" >/dev/null
  trap 'git worktree remove --force "$src"; rm -rf "$dir"' EXIT
  if [[ -n $patch ]]; then git -C "$src" apply "$patch"; fi
fi
hopper=0
if [[ ${1:-} == --hopper ]]; then hopper=1; shift; fi
out=.device/logp
for object in logp_bench_lib.o linear_logp_cuda.o kernel_kind.o; do
  [[ -f $out/$object ]] || { echo "$out/$object missing: run tools/device/build_logp.sh first" >&2; exit 1; }
done
flags=(-std=c++17 -O3 "-I$src" -Xcompiler -fPIC -Xcompiler -ffp-contract=off -Xptxas -v "$@")
"$NVCC" "${flags[@]}" -gencode=arch=compute_90,code=sm_90 \
  -c "$src/kernels/cuda/linear_logp_portable.cu" -o "$dir/portable.o" 2> "$dir/ptxas.log" ||
  { cat "$dir/ptxas.log" >&2; exit 1; }
hopper_object=$out/linear_logp_cuda.o
if (( hopper )); then
  "$NVCC" "${flags[@]}" $ARCH -c "$src/kernels/cuda/linear_logp_cuda.cu" -o "$dir/hopper.o" \
    2>> "$dir/ptxas.log" || { cat "$dir/ptxas.log" >&2; exit 1; }
  hopper_object=$dir/hopper.o
fi
grep -E "spill|registers" "$dir/ptxas.log" | sort | uniq -c | sort -rn | head -6
"$NVCC" $ARCH -shared -o "$out/liblogp_bench_$name.so" "$out/logp_bench_lib.o" \
  "$hopper_object" "$dir/portable.o" "$out/kernel_kind.o" $(absl_link_flags)
echo "built $out/liblogp_bench_$name.so"
