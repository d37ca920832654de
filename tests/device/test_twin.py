"""twin: detlogp.torch on CUDA. Its pytest cases (less the one comparing
with a CPU server: the server here picks the GPU; CI runs it), none of the
CUDA cases skipped; under torch.compile and CUDA graphs; twin_check.py (the
op's bits == the CUDA server's, gradients, memory, overhead;
DETLOGP_TWIN_CHECK_ARGS="..." are its arguments); and
examples/grpo_twin_step.py against a GPU server serving a random bf16
lm_head with a bias."""

import os
import re

import numpy as np
import pytest
from nested_pytest import assert_passed, run_pytest

pytestmark = pytest.mark.twin

CUDA_COMPILE_CASES = re.compile(r"test_(cuda_graph|reduce_overhead|opcheck_the_fused)")


def test_torch_ops_on_cuda(bundle, out):
    tests = bundle.root / "python" / "client" / "tests"
    rc, cases = run_pytest(
        "torch_ops",
        [tests / "test_torch_ops.py"],
        out,
        args=["-k", "not cpu_bits_equal_the_cpu_server"],
    )
    assert_passed("torch_ops", rc, cases, out)
    skipped = [
        c.name
        for c in cases
        if c.outcome == "skipped"
        and "test_cuda_forward_is_batch_invariant_and_backward_runs" in c.name
    ]
    assert not skipped, f"the CUDA case skipped on a GPU host: {skipped}"


def test_torch_compile_and_cuda_graphs(bundle, out):
    tests = bundle.root / "python" / "client" / "tests"
    rc, cases = run_pytest("torch_compile", [tests / "test_torch_compile.py"], out)
    assert_passed("torch_compile", rc, cases, out)
    skipped = [
        c.name for c in cases if c.outcome == "skipped" and CUDA_COMPILE_CASES.search(c.name)
    ]
    assert not skipped, f"CUDA cases skipped on a GPU host: {skipped}"


def test_twin_check(bundle, run):
    run(
        "twin_check",
        [
            "python3",
            bundle.script("twin_check.py"),
            f"--server={bundle.server}",
            *os.environ.get("DETLOGP_TWIN_CHECK_ARGS", "").split(),
        ],
        timeout_s=900,
    )


def test_grpo_twin_step_against_a_gpu_server(bundle, serving, run, tmp_path):
    import ml_dtypes
    from detlogp import safetensors_io

    weights = tmp_path / "lm_head.safetensors"
    rng = np.random.default_rng()
    w = (rng.standard_normal((151936, 4096), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(151936, dtype=np.float32) * 0.1
    safetensors_io.write(weights, {"lm_head.weight": w, "lm_head.bias": b})
    del w
    with serving(
        "grpo", "--device=cuda:0", f"--weights={weights}", "--bias_tensor=lm_head.bias"
    ) as server:
        run(
            "grpo_twin_step",
            [
                "python3",
                bundle.script("grpo_twin_step.py"),
                "--target",
                server.target,
                "--weights",
                weights,
                "--bias_tensor",
                "lm_head.bias",
            ],
            timeout_s=600,
        )
