"""portable: the portable mma.sync kernel, which runs on every GPU from
Ampere on. memcheck on small shapes and its GPU gtests; then served with
--logp_kernel=portable: the server's log and ModelInfo name the kernel and
the device's instruction set (read from the device), its determinism key
differs from the Hopper kernel's (on a Hopper GPU; elsewhere that check is
not applicable), bits over gRPC hold under 64 concurrent callers, and
served rows/s against the kernel alone meets its gate (gates.py)."""

import os

import detlogp
import gates
import pytest
from gpu import not_hopper_reason
from gtest import assert_gtest_passed, memcheck, run_gtest
from models import SYNTHETIC_MODEL

pytestmark = pytest.mark.portable

PORTABLE_KERNEL = "portable-mma-sync-v1"
SERVE_SECONDS = float(os.environ.get("DETLOGP_SERVE_SECONDS", "10"))


def test_memcheck_small_shapes(bundle, out):
    name = "linear_logp_portable_test"
    result = memcheck(bundle, name, bundle.memcheck_filters()[name], out)
    print(result.summary())
    assert_gtest_passed(result)


def test_portable_gtests(bundle, out):
    result = run_gtest(bundle, "linear_logp_portable_test", out, timeout_s=400)
    print(result.summary())
    assert_gtest_passed(result)


@pytest.fixture(scope="module")
def portable_server(serving):
    with serving(
        "portable",
        "--device=cuda:0",
        "--logp_kernel=portable",
        *SYNTHETIC_MODEL,
        "--max_queue_rows=262144",
    ) as server:
        yield server


def model_info(target):
    with detlogp.Client(target, timeout=60.0) as client:
        return client.info()


def test_served_kernel_and_instruction_set(portable_server, gpu):
    assert f"kernel {PORTABLE_KERNEL}" in portable_server.log(), (
        "the server's log does not name the portable kernel"
    )
    info = model_info(portable_server.target)
    assert info.kernel_version == PORTABLE_KERNEL
    # The device's compute capability and machine code the build shipped
    # (sass_sm_*; a JIT-compiled PTX would be named jit_compute_*).
    assert f"isa {gpu.sm}/sass_sm_" in info.backend, info.backend


def test_determinism_key_differs_from_hoppers(serving, portable_server, gpu):
    if not gpu.is_hopper:
        pytest.skip(not_hopper_reason(gpu))
    with serving("hopper", "--device=cuda:0", "--logp_kernel=hopper", *SYNTHETIC_MODEL) as hopper:
        hopper_key = model_info(hopper.target).determinism_key
    portable_key = model_info(portable_server.target).determinism_key
    assert portable_key and hopper_key and portable_key != hopper_key, (portable_key, hopper_key)


@pytest.mark.parametrize("extras", [[], ["--entropy", "--top_k=20"]], ids=["logp", "extras"])
def test_bits_under_concurrent_callers(bundle, portable_server, run, extras):
    run(
        "invariance" + ("_extras" if extras else ""),
        [
            bundle.cli,
            "check-invariance",
            f"--target={portable_server.target}",
            "--probes=32",
            "--concurrency=64",
            "--calls_per_thread=4",
            "--channels=8",
            *extras,
        ],
        timeout_s=300,
    )


def test_served_rows_per_s_against_the_kernel_alone(bundle, portable_server, run, out, figures):
    served = run(
        "throughput_256",
        [
            bundle.bin("serve_throughput"),
            f"--target={portable_server.target}",
            "--rows=256",
            "--callers=64",
            "--channels=16",
            f"--seconds={SERVE_SECONDS}",
            "--warmup_seconds=2",
        ],
        timeout_s=SERVE_SECONDS + 120,
        json_path="stdout",
    )
    assert served["errors"] == 0 and served["bad_answers"] == 0, served
    report = out / "kernel_only.json"
    kernel = run(
        "kernel_only",
        [
            "python3",
            bundle.script("logp_portable_bench.py"),
            "--lib",
            bundle.lib("liblogp_bench.so"),
            "--ns",
            "256,4096",
            "--reps",
            "20",
            "--json",
            report,
        ],
        timeout_s=300,
        json_path=report,
    )
    ms = {row["n"]: row["portable_ms"] for row in kernel["rows"]}
    kernel_rows_per_s = 256 / (ms[256] / 1e3)
    ratio = served["rows_per_s"] / kernel_rows_per_s
    figures.update(
        served_rows_per_s=served["rows_per_s"],
        kernel_only_rows_per_s_n256=kernel_rows_per_s,
        kernel_only_rows_per_s_n4096=4096 / (ms[4096] / 1e3),
        served_over_kernel=ratio,
    )
    print(
        f"served {served['rows_per_s']:.0f} rows/s; kernel-only N=256 "
        f"{kernel_rows_per_s:.0f} rows/s; ratio {ratio:.3f}"
    )
    gates.at_least(
        "portable served / kernel-only rows/s (N=256)",
        ratio,
        gates.PORTABLE_SERVED_OVER_KERNEL_MIN,
    )
