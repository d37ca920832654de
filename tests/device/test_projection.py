"""projection: the projection's GPU gtests; its SASS (the forward and dX
loops are FFMA chains: no FMUL/FADD splitting an fma, no local memory);
the kernels (projection_bench) and PyTorch in the same run
(projection_bench.py). DETLOGP_PROJECTION_ROWS lists the row counts."""

import collections
import os
import re
import shutil
import subprocess

import pytest
from gtest import assert_gtest_passed, run_gtest

pytestmark = pytest.mark.projection

ROWS = os.environ.get(
    "DETLOGP_PROJECTION_ROWS", "1,128,1024,4096,13104,37296,72576,102816,108576,364608"
)


@pytest.mark.parametrize("name", ["projection_cuda_test", "projection_backend_cuda_test"])
def test_projection_gtests(bundle, out, name):
    result = run_gtest(bundle, name, out, timeout_s=300)
    print(result.summary())
    assert_gtest_passed(result)


def test_sass_instruction_mix(bundle, out, figures):
    tool = shutil.which("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not found on this host")
    sass = subprocess.run(
        [tool, "--dump-sass", str(bundle.bin("projection_bench"))],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    (out / "sass.txt").write_text(sass)
    counts = collections.Counter()
    function = None
    for line in sass.splitlines():
        if "Function : " in line:
            function = line.split("Function : ", 1)[1].strip()
        found = re.search(r"\b(FFMA|FMUL|FADD|LDL|STL)\b", line)
        if found and function:
            counts[f"{function} {found.group(1)}"] += 1
    figures["sass"] = dict(sorted(counts.items()))
    assert any(key.endswith(" FFMA") for key in counts), "no FFMA in projection_bench's SASS"


def test_kernels_beside_pytorch(bundle, out, run, figures):
    ours = out / "ours.json"
    run(
        "projection_bench",
        [bundle.bin("projection_bench"), f"--rows={ROWS}", "--reps=25", f"--json={ours}"],
        timeout_s=300,
    )
    report = out / "bench.json"
    figures["bench"] = run(
        "projection_bench_py",
        [
            "python3",
            bundle.script("projection_bench.py"),
            "--ours",
            ours,
            f"--rows={ROWS}",
            "--json",
            report,
            "--md",
            out / "table.md",
        ],
        timeout_s=300,
        json_path=report,
    )


@pytest.mark.skipif(os.environ.get("DETLOGP_NCU") != "1", reason="DETLOGP_NCU=1 runs it")
@pytest.mark.parametrize("kernel", ["ProjectionForwardKernel", "ProjectionForwardWideKernel"])
def test_ncu_sections_of_the_forward_kernels(bundle, run, kernel):
    """Where the forward's time goes (no clock control: the card as found)."""
    tool = shutil.which("ncu")
    assert tool, "ncu (Nsight Compute) not found on this host (PATH)"
    run(
        f"ncu_{kernel}",
        [
            tool,
            "--clock-control",
            "none",
            "--kernel-name",
            f"regex:{kernel}",
            "--launch-skip",
            "3",
            "--launch-count",
            "1",
            "--section",
            "SpeedOfLight",
            "--section",
            "ComputeWorkloadAnalysis",
            "--section",
            "WarpStateStats",
            "--section",
            "Occupancy",
            bundle.bin("projection_bench"),
            "--rows=102816",
            "--reps=20",
        ],
        timeout_s=120,
    )
