"""live_weights: versions swapped under load with every answer's bits
checked, two models, --model_root persistence and restart, and the
live-weights gtests against a server on cuda:0. Knobs:
DETLOGP_SWAP_STEADY_S (10) and DETLOGP_SWAP_S (60), the swap phase's
seconds. Figures go to <device_out>/live_weights/figures.json."""

import os

import detlogp
import pytest
from gtest import assert_gtest_passed, run_gtest
from models import SYNTHETIC_MODEL
from serving_checks import check_invariance, throughput

pytestmark = pytest.mark.live_weights

MODEL = [
    "--device=cuda:0",
    *SYNTHETIC_MODEL,
    "--max_batch_rows=4096",
    "--max_queue_delay_us=0",
    "--max_queue_rows=262144",
]
STEADY_S = os.environ.get("DETLOGP_SWAP_STEADY_S", "10")
SWAP_S = os.environ.get("DETLOGP_SWAP_S", "60")


def test_live_weights_gtests_against_a_gpu_server(bundle, out):
    # Two cases need a request that outlasts an UnloadModel call or a
    # publish; the GPU answers theirs first, so they stay with CI's CPU
    # servers.
    result = run_gtest(
        bundle,
        "live_weights_test",
        out,
        timeout_s=900,
        args=[
            "--gtest_filter=-*UnloadWaitsForTheVersionsRequests*:*MultiSliceRequestNeverMixesVersions*"
        ],
        env={"DETLOGP_TEST_DEVICE": "cuda:0"},
    )
    print(result.summary())
    assert_gtest_passed(result)


def swap_under_load(run, bundle, target, name, steady_s, swap_s, *extra):
    result = run(
        name,
        [
            bundle.bin("swap_under_load"),
            f"--target={target}",
            "--model=policy",
            "--callers=64",
            "--channels=16",
            "--rows=256",
            f"--steady_seconds={steady_s}",
            f"--swap_seconds={swap_s}",
            "--swap_every_seconds=2",
            *extra,
        ],
        timeout_s=float(steady_s) + float(swap_s) + 300,
        json_path="stdout",
    )
    assert result["failed_pushes"] == 0 and result["failed_calls"] == 0, result
    assert result["answers_differing"] == 0 and result["solo_rows_differing"] == 0, result
    return result


def test_versions_kept_swapped_under_load(bundle, serving, run, figures):
    with serving("a", *MODEL, "--max_versions_per_model=64") as server:
        check_invariance(run, bundle, server.target)
        one = throughput(run, bundle, server.target, "one_model", 256, 64, 16, 10)
        swap = swap_under_load(run, bundle, server.target, "swap", STEADY_S, SWAP_S)
        two = throughput(
            run,
            bundle,
            server.target,
            "two_models",
            256,
            64,
            16,
            10,
            extra=["--models=default,policy"],
        )
    figures.update(
        one_model_rows_per_s=one["rows_per_s"],
        two_models_rows_per_s=two["rows_per_s"],
        two_over_one=two["rows_per_s"] / one["rows_per_s"],
        swap=swap,
    )


def identity(target):
    with detlogp.Client(target, timeout=60.0) as client:
        info = client.info(model="policy")
    return info.model_version, info.determinism_key, info.weights_sha256


def test_model_root_persists_versions_across_a_restart(bundle, serving, run, tmp_path, figures):
    root = tmp_path / "model_root"
    root.mkdir()
    with serving("b", *MODEL, f"--model_root={root}") as server:
        run(
            "live_weights_bench",
            [
                "python3",
                bundle.script("live_weights_bench.py"),
                f"--target={server.target}",
                f"--model_root={root}",
                "--repeats=3",
            ],
            timeout_s=600,
        )
        figures["swap_persisted"] = swap_under_load(
            run, bundle, server.target, "swap_persisted", 5, 20, "--solo_check=false"
        )
        before = identity(server.target)
    with serving("c", *MODEL, f"--model_root={root}") as server:
        after = identity(server.target)
    assert before[0] > 0 and before == after, f"before restart {before}, after {after}"
