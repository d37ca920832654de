#!/usr/bin/env bash
# On the device machine (carry .device/backward from
# tools/device/build_backward.sh, and .whl: grpcio/protobuf, liger-kernel): the MN-major wgmma
# micro test first (which descriptor field takes which stride), then the
# backward's GPU tests, then — when both passed, or with BENCH=1 — the
# forward + backward bench beside PyTorch eager and Liger
# (tools/device/logp_backward_bench.py; SIZES=1024,4096 to shorten it).
# Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
dir=.device/backward
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tests_ok=1
timeout 60 "$dir/wgmma_mn_major_test" 2>&1 | tee "$OUT/wgmma_mn_major.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || tests_ok=0
timeout "${BACKWARD_TIMEOUT:-240}" "$dir/linear_logp_backward_test" 2>&1 | tee "$OUT/backward.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || tests_ok=0
if [[ $tests_ok -eq 1 || ${BENCH:-0} -eq 1 ]]; then
  # .whl: grpcio/protobuf for the detlogp package (as run_twin.sh) and
  # liger-kernel.
  site=""
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/bwd-site \
      .whl/*.whl && site=/tmp/bwd-site:
  fi
  export DETLOGP_OPS_CUDA_LIBRARY="$PWD/$dir/libdetlogp_ops_cuda.so"
  PYTHONPATH="${site}$PWD/client/python" timeout "${BENCH_TIMEOUT:-300}" \
    python3 tools/device/logp_backward_bench.py --sizes "${SIZES:-1024,4096,8192,16384}" \
    2>&1 | tee "$OUT/backward_bench.log"
fi
