#!/usr/bin/env bash
# On the device machine (carry .device/backward): the MN-major wgmma micro
# test first (which descriptor field takes which stride), then the
# backward's GPU tests. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
dir=.device/backward
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 60 "$dir/wgmma_mn_major_test" 2>&1 | tee "$OUT/wgmma_mn_major.log"
timeout "${BACKWARD_TIMEOUT:-240}" "$dir/linear_logp_backward_test" 2>&1 | tee "$OUT/backward.log"
