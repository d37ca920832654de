#!/usr/bin/env bash
# Runs examples/grpo_twin_step.py on the device machine against the CUDA
# server (issue #14's example): a random bf16 lm_head (H=4096, V=151936, with
# a bias) written to safetensors, the server from .device/twin serving it on
# cuda:0, the example on the GPU with detlogp.torch. Carry .device/twin and
# .whl (grpcio/protobuf for the Python client).
set -uo pipefail
cd "$(dirname "$0")/../.."
dir=.device/twin
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
export DETLOGP_OPS_LIBRARY="$PWD/$dir/libdetlogp_ops.so"
export DETLOGP_OPS_CUDA_LIBRARY="$PWD/$dir/libdetlogp_ops_cuda.so"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/grpo-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/grpo-site:$PWD/client/python
python3 - <<'PY' || exit 1
import ml_dtypes, numpy as np
from detlogp import safetensors_io
rng = np.random.default_rng()
w = (rng.standard_normal((151936, 4096), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
b = (rng.standard_normal(151936, dtype=np.float32) * 0.1)
safetensors_io.write("/tmp/lm_head.safetensors", {"lm_head.weight": w, "lm_head.bias": b})
PY
rm -f /tmp/grpo.port
"$dir/detlogp_server" --port=0 --port_file=/tmp/grpo.port --device=cuda:0 \
  --weights=/tmp/lm_head.safetensors --bias_tensor=lm_head.bias > /tmp/grpo_server.log 2>&1 &
server=$!
for _ in $(seq 1 900); do [[ -s /tmp/grpo.port ]] && break; sleep 0.2; done
python3 examples/grpo_twin_step.py --target "127.0.0.1:$(head -1 /tmp/grpo.port)" \
  --weights /tmp/lm_head.safetensors --bias_tensor lm_head.bias
rc=$?
kill -TERM $server; wait $server
exit $rc
