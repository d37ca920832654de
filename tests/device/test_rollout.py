"""rollout: the client's shared-memory and C++-client pytest cases on the
GPU (none may skip for want of a CUDA device), then one caller's large batch
through the Python client (system and CUDA regions, TCP, Unix socket)
against detlogp.torch in the same process, and the bits of every path
(rollout_worker_bench.py; DETLOGP_ROLLOUT_ARGS="..." are its arguments,
DETLOGP_ROLLOUT_PYTEST=0 leaves the pytest cases out)."""

import json
import os

import pytest
from nested_pytest import assert_passed, run_pytest

pytestmark = pytest.mark.rollout

ROLLOUT_ARGS = os.environ.get("DETLOGP_ROLLOUT_ARGS", "").split()


@pytest.mark.skipif(
    os.environ.get("DETLOGP_ROLLOUT_PYTEST") == "0", reason="DETLOGP_ROLLOUT_PYTEST=0"
)
def test_client_gpu_cases(bundle, out):
    tests = bundle.root / "python" / "client" / "tests"
    rc, cases = run_pytest(
        "client_gpu", [tests / "test_shared_memory.py", tests / "test_native_transport.py"], out
    )
    assert_passed("client_gpu", rc, cases, out)
    no_device = [c.name for c in cases if c.outcome == "skipped" and "no CUDA device" in c.message]
    assert not no_device, f"skipped for want of a CUDA device on a GPU host: {no_device}"


def test_large_batch_bits_on_every_path(bundle, out, run, figures):
    report = out / "rollout.json"
    run(
        "rollout_worker_bench",
        [
            "python3",
            bundle.script("rollout_worker_bench.py"),
            f"--server={bundle.server}",
            f"--json_out={report}",
            *ROLLOUT_ARGS,
        ],
        timeout_s=560,
    )
    lines = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    bits = [line for line in lines if "bits_failures" in line]
    assert bits, f"no bits record in {report}"
    assert bits[-1]["bits_failures"] == [], bits[-1]["bits_failures"]
    figures["rollout"] = [line for line in lines if "bits_failures" not in line]
