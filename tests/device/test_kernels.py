"""kernels: the Hopper linear-logp kernel. Its GPU gtests and the top-k
pieces', compute-sanitizer memcheck on small shapes, its SASS (wgmma, no
local memory), the kernel against PyTorch eager and the weight-read floor
(logp_bench.py; DETLOGP_LOGP_BENCH_ARGS="..." are its arguments), entropy
and top-k costs (logp_extras_bench.py, which checks their bits;
DETLOGP_EXTRAS_BENCH_ARGS), the wgmma rate bench. DETLOGP_TUNING=1 adds the
item-order row groups and the portable kernel's bench (DETLOGP_RLKERNEL=DIR:
beside a staged RL-Kernel).

On a GPU other than compute capability 9.0 the suite is not applicable and
every case skips with that reason."""

import os
import re
import shutil
import subprocess

import pytest
from gpu import not_hopper_reason
from gtest import assert_gtest_passed, memcheck, run_gtest

pytestmark = pytest.mark.kernels

BENCH_ARGS = os.environ.get("DETLOGP_LOGP_BENCH_ARGS", "").split()
EXTRAS_ARGS = os.environ.get("DETLOGP_EXTRAS_BENCH_ARGS", "").split()


@pytest.fixture(autouse=True)
def hopper_only(gpu):
    if not gpu.is_hopper:
        pytest.skip(not_hopper_reason(gpu))


@pytest.mark.parametrize(
    "name, timeout_s",
    [("linear_logp_cuda_test", 300), ("top_k_screens_test", 120), ("top_k_floor_test", 120)],
)
def test_kernel_gtests(bundle, out, name, timeout_s):
    result = run_gtest(bundle, name, out, timeout_s=timeout_s)
    print(result.summary())
    assert_gtest_passed(result)


def test_memcheck_small_shapes(bundle, out):
    name = "linear_logp_cuda_test"
    result = memcheck(bundle, name, bundle.memcheck_filters()[name], out)
    print(result.summary())
    assert_gtest_passed(result)


def test_sass_uses_wgmma_and_no_local_memory(bundle, out, figures):
    """The Hopper kernel multiplies with wgmma and keeps its state in
    registers: HGMMA present, no local-memory loads or stores."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not found on this host")
    sass = subprocess.run(
        [tool, "--dump-sass", str(bundle.lib("liblogp_bench.so"))],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    (out / "sass.txt").write_text(sass)
    hgmma = len(re.findall(r"\bHGMMA\b", sass))
    local = len(re.findall(r"\b(LDL|STL)\b", sass))
    figures["sass_hgmma"] = hgmma
    figures["sass_local_memory_instructions"] = local
    print(f"SASS of liblogp_bench.so: {hgmma} HGMMA, {local} local-memory instructions")
    assert hgmma > 0, "no HGMMA instruction in liblogp_bench.so's SASS"


def test_logp_bench_against_eager_and_floor(bundle, out, run, figures):
    report = out / "bench.json"
    result = run(
        "logp_bench",
        [
            "python3",
            bundle.script("logp_bench.py"),
            "--lib",
            bundle.lib("liblogp_bench.so"),
            "--json",
            report,
            *BENCH_ARGS,
        ],
        timeout_s=300,
        json_path=report,
    )
    figures["floor_ms"] = result["floor_ms"]
    for row in result["rows"]:
        figures[f"invariant_ms_n{row['n']}"] = row["invariant_ms"]
        if "torch_ms" in row:
            figures[f"torch_ms_n{row['n']}"] = row["torch_ms"]


def test_entropy_and_top_k_bits_and_costs(bundle, out, run, figures):
    report = out / "extras.json"
    result = run(
        "logp_extras_bench",
        [
            "python3",
            bundle.script("logp_extras_bench.py"),
            "--lib",
            bundle.lib("liblogp_bench.so"),
            "--json",
            report,
            *EXTRAS_ARGS,
        ],
        timeout_s=300,
        json_path=report,
    )
    figures["extras_rows"] = len(result["rows"])


def test_wgmma_rate(bundle, run):
    run("wgmma_rate_bench", [bundle.bin("wgmma_rate_bench")], timeout_s=120)


@pytest.mark.skipif(os.environ.get("DETLOGP_TUNING") != "1", reason="DETLOGP_TUNING=1 runs it")
def test_tuning_row_groups(bundle, run):
    run(
        "row_groups",
        [
            "python3",
            bundle.script("logp_row_group_bench.py"),
            "--lib",
            bundle.lib("liblogp_bench.so"),
            "--groups",
            "8,16,32,64",
            "--ns",
            "1024,2048,4096,8192",
            "--reps",
            "15",
        ],
        timeout_s=300,
    )


@pytest.mark.skipif(os.environ.get("DETLOGP_TUNING") != "1", reason="DETLOGP_TUNING=1 runs it")
def test_tuning_portable_beside_rlkernel(bundle, out, run):
    rlkernel = os.environ.get("DETLOGP_RLKERNEL")
    run(
        "portable_bench",
        [
            "python3",
            bundle.script("logp_portable_bench.py"),
            "--lib",
            bundle.lib("liblogp_bench.so"),
            "--ns",
            "64,1024,2048,4096,8192",
            "--reps",
            "15",
            "--json",
            out / "portable_bench.json",
            *(["--rlkernel", rlkernel] if rlkernel else []),
        ],
        timeout_s=300,
    )
