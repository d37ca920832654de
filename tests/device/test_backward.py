"""backward: the fused backward. The MN-major wgmma test and the backward's
GPU gtests; then forward + backward beside PyTorch eager and Liger
(logp_backward_bench.py) and detlogp.torch's training step beside eager and
torch.compile (twin_train_bench.py), each of which exits non-zero when one
of its checks fails. DETLOGP_BACKWARD_SIZES (1024,4096,8192,16384) are the
benches' row counts. The MN-major wgmma test is Hopper only (sm_90a):
elsewhere it skips with that reason, and the backward's Hopper cases skip
themselves."""

import os

import pytest
from gpu import not_hopper_reason
from gtest import assert_gtest_passed, run_gtest

pytestmark = pytest.mark.backward

SIZES = os.environ.get("DETLOGP_BACKWARD_SIZES", "1024,4096,8192,16384")
BENCH_TIMEOUT_S = float(os.environ.get("DETLOGP_BENCH_TIMEOUT_S", "300"))


def test_wgmma_mn_major(bundle, gpu, out):
    if not gpu.is_hopper:
        pytest.skip(not_hopper_reason(gpu))
    result = run_gtest(bundle, "wgmma_mn_major_test", out, timeout_s=60)
    print(result.summary())
    assert_gtest_passed(result)


def test_backward_gtests(bundle, gpu, out):
    timeout_s = float(os.environ.get("DETLOGP_BACKWARD_TIMEOUT_S", "240"))
    result = run_gtest(bundle, "linear_logp_backward_test", out, timeout_s=timeout_s)
    print(result.summary())
    assert_gtest_passed(result, skips_allowed=not gpu.is_hopper)


def test_forward_backward_beside_eager_and_liger(bundle, run):
    run(
        "logp_backward_bench",
        ["python3", bundle.script("logp_backward_bench.py"), "--sizes", SIZES],
        timeout_s=BENCH_TIMEOUT_S,
    )


def test_training_step_beside_eager_and_compile(bundle, run):
    run(
        "twin_train_bench",
        ["python3", bundle.script("twin_train_bench.py"), "--sizes", SIZES],
        timeout_s=BENCH_TIMEOUT_S,
    )
