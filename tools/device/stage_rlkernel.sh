#!/usr/bin/env bash
# Stages RL-Kernel's fused linear-logp kernel (mma.sync + TMA, throughput
# split; issue #13's "RL-Kernel" baseline) for a same-run comparison on the
# device machine: copies its two source files from a fetched RL-Kernel git
# directory into .device/logp/rlkernel/ (git-ignored; third-party code never
# enters the repository). tools/device/rlkernel_baseline.py builds it there
# with PyTorch's extension builder.
#   tools/device/stage_rlkernel.sh /work/.mirror/RL-Align+RL-Kernel/repo [COMMIT]
set -euo pipefail
cd "$(dirname "$0")/../.."
git_dir=${1:?usage: stage_rlkernel.sh RL-KERNEL-GIT-DIR [COMMIT]}
commit=${2:-HEAD}
out=.device/logp/rlkernel
rm -rf "$out"
mkdir -p "$out/csrc/cuda" "$out/csrc/utils"
for file in csrc/cuda/fused_linear_logp_sm90.cu csrc/utils/tma_utils.cuh; do
  git --git-dir="$git_dir" show "$commit:$file" > "$out/$file"
done
git --git-dir="$git_dir" rev-parse "$commit" > "$out/COMMIT"
echo "staged RL-Kernel $(cat "$out/COMMIT") in $out"
