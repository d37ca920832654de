#!/usr/bin/env bash
# The trainer's twin on the GPU (issue #14). Runs on the device machine from
# the repository root, with .device/twin carried (tools/device/build_twin.sh)
# and, when the machine's grpcio/protobuf are too old, .whl:
#   1. pytest client/python/tests/test_torch_ops.py (gradcheck on the CPU
#      float64 path, CPU kernels' bits, fake tensors, the CUDA case), less the
#      case that compares with a CPU server (the server here picks the GPU;
#      CI runs it);
#   2. kernels/capi/detlogp_ops_cuda_capture_test: the C ABI captured in a
#      CUDA graph (a head made during the capture) == direct calls (bits);
#   3. pytest client/python/tests/test_torch_compile.py: opcheck on every
#      op (CPU and CUDA, the fused backward included), compiled forward and
#      backward == eager (bits), torch.cuda.graph and
#      torch.compile(mode="reduce-overhead") replays == eager (bits);
#   4. tools/device/twin_check.py: 10^5 rows of detlogp.torch on CUDA ==
#      the CUDA server's bits (memcmp), the key, the H3 projection and its
#      gradients, chunked-backward accuracy vs float64 beside PyTorch eager,
#      peak backward memory, forward-through-op overhead vs the kernel alone.
# Prints PASS/FAIL lines and ends with "N passed, M failed"; exits non-zero
# on any failure. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
dir=.device/twin
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [[ ! -x $dir/detlogp_server || ! -f $dir/libdetlogp_ops_cuda.so ]]; then
  echo "FAIL setup: $dir is missing: run tools/device/build_twin.sh here and carry $dir"
  echo "0 passed, 1 failed"; exit 1
fi
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
export DETLOGP_OPS_LIBRARY="$PWD/$dir/libdetlogp_ops.so"
export DETLOGP_OPS_CUDA_LIBRARY="$PWD/$dir/libdetlogp_ops_cuda.so"
export DETLOGP_SERVER="$PWD/$dir/detlogp_server"
export PYTHONUNBUFFERED=1
site=""
if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/twin-site .whl/*.whl && site=/tmp/twin-site:
fi
export PYTHONPATH="${site}$PWD/client/python"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "grpcio", grpc.__version__, "protobuf", p.__version__)'

status=0
passed=0; failed=0
echo "== pytest: detlogp.torch"
if python3 -m pytest -v -p no:cacheprovider -o addopts="" \
    -k "not cpu_bits_equal_the_cpu_server" client/python/tests/test_torch_ops.py \
    > "$OUT/pytest.log" 2>&1; then
  echo "PASS pytest: $(tail -1 "$OUT/pytest.log")"; passed=$((passed + 1))
else
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
  echo "FAIL pytest: $(tail -1 "$OUT/pytest.log") (log: \$OUT/pytest.log)"
  failed=$((failed + 1)); status=1
fi
if grep -q "test_cuda_forward_is_batch_invariant_and_backward_runs SKIPPED" "$OUT/pytest.log"; then
  echo "FAIL pytest: the CUDA case was skipped on a GPU machine"; failed=$((failed + 1)); status=1
fi

echo "== the CUDA C ABI under CUDA-graph capture"
if [[ -x $dir/detlogp_ops_cuda_capture_test ]]; then
  $dir/detlogp_ops_cuda_capture_test > "$OUT/capture_test.log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]] && ! grep -q "SKIPPED \]" "$OUT/capture_test.log"; then
    echo "PASS capture test: $(grep -E '^\[  PASSED' "$OUT/capture_test.log")"
    passed=$((passed + 1))
  else
    grep -E "Failure|SKIPPED|error" "$OUT/capture_test.log" | head -20
    echo "FAIL capture test (rc $rc; log: \$OUT/capture_test.log)"
    failed=$((failed + 1)); status=1
  fi
else
  echo "FAIL capture test: $dir/detlogp_ops_cuda_capture_test is missing (build_twin.sh)"
  failed=$((failed + 1)); status=1
fi

echo "== pytest: detlogp.torch under torch.compile and CUDA graphs"
if python3 -m pytest -v -p no:cacheprovider -o addopts="" \
    client/python/tests/test_torch_compile.py > "$OUT/pytest_compile.log" 2>&1; then
  echo "PASS pytest compile/graphs: $(tail -1 "$OUT/pytest_compile.log")"
  passed=$((passed + 1))
else
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_compile.log" | head -20
  echo "FAIL pytest compile/graphs: $(tail -1 "$OUT/pytest_compile.log")" \
    "(log: \$OUT/pytest_compile.log)"
  failed=$((failed + 1)); status=1
fi
if grep -E "test_(cuda_graph|reduce_overhead|opcheck_the_fused)[a-z_]* SKIPPED" \
    "$OUT/pytest_compile.log"; then
  echo "FAIL pytest compile/graphs: a CUDA case was skipped on a GPU machine"
  failed=$((failed + 1)); status=1
fi

echo "== twin_check.py"
python3 tools/device/twin_check.py --server="$DETLOGP_SERVER" "$@" 2>&1 | tee "$OUT/twin_check.log"
rc=${PIPESTATUS[0]}
p=$(grep -c "^PASS" "$OUT/twin_check.log"); f=$(grep -c "^FAIL" "$OUT/twin_check.log")
passed=$((passed + p)); failed=$((failed + f))
if [[ $rc -ne 0 ]]; then status=1; [[ $f -eq 0 ]] && failed=$((failed + 1)); fi
echo "$passed passed, $failed failed"
exit $status
