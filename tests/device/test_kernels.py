"""kernels: the Hopper linear-logp kernel. Its GPU gtests and the top-k
pieces', compute-sanitizer memcheck on small shapes, its SASS (wgmma, no
local memory), the kernel against PyTorch eager and the weight-read floor
(logp_bench.py; DETLOGP_LOGP_BENCH_ARGS="..." are its arguments), entropy
and top-k costs (logp_extras_bench.py, which checks their bits;
DETLOGP_EXTRAS_BENCH_ARGS), the wgmma rate bench. DETLOGP_TUNING=1 adds the
item-order row groups and the portable kernel's bench (DETLOGP_RLKERNEL=DIR:
beside a staged RL-Kernel); DETLOGP_AB_LIBS an A/B of bench libraries;
DETLOGP_NCU=1 each kernel's duration under ncu; DETLOGP_SASS_PROFILE=1
per-instruction stall samples of the split kernel.

On a GPU other than compute capability 9.0 the suite is not applicable and
every case skips with that reason."""

import json
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
    """The Hopper kernel multiplies with wgmma: HGMMA present. The count of
    local-memory instructions is recorded (the library holds the portable
    kernel too)."""
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


def extras_bench(bundle, lib, *args):
    return ["python3", bundle.script("logp_extras_bench.py"), "--lib", lib, *args]


@pytest.mark.skipif(
    not os.environ.get("DETLOGP_AB_LIBS"), reason='DETLOGP_AB_LIBS="a.so b.so" runs it'
)
def test_ab_of_bench_libraries(bundle, out, run):
    """An interleaved A/B of bench libraries: rounds alternate the order (a
    b, then b a, ...), since in interleaved timing a kernel starts at the
    clock the one before it left; libraries are compared within one run,
    and the same seed's digests across them (ab_summary.py fails on one
    that differs). DETLOGP_AB_ROUNDS (2), DETLOGP_AB_KERNEL (hopper),
    DETLOGP_AB_NS (1024,2048,4096), DETLOGP_AB_REPS (21)."""
    libs = os.environ["DETLOGP_AB_LIBS"].split()
    rounds = []
    for number in range(1, int(os.environ.get("DETLOGP_AB_ROUNDS", "2")) + 1):
        for index, lib in enumerate(libs if number % 2 else list(reversed(libs))):
            report = out / f"ab_round{number}_{index}.json"
            run(
                f"ab_round{number}_{index}",
                extras_bench(
                    bundle,
                    lib,
                    "--kernel",
                    os.environ.get("DETLOGP_AB_KERNEL", "hopper"),
                    "--seed",
                    "8",
                    "--ns",
                    os.environ.get("DETLOGP_AB_NS", "1024,2048,4096"),
                    "--reps",
                    os.environ.get("DETLOGP_AB_REPS", "21"),
                    "--no-torch",
                    "--json",
                    report,
                ),
                timeout_s=float(os.environ.get("DETLOGP_BENCH_TIMEOUT_S", "300")),
            )
            rounds.append({"round": number, "lib": lib, "report": str(report)})
    (out / "ab.json").write_text(json.dumps({"rounds": rounds}, indent=1))
    run("ab_summary", ["python3", bundle.script("ab_summary.py"), out / "ab.json"], timeout_s=60)


def ncu():
    tool = shutil.which("ncu")
    assert tool, "ncu (Nsight Compute) not found on this host (PATH)"
    return tool


@pytest.mark.skipif(os.environ.get("DETLOGP_NCU") != "1", reason="DETLOGP_NCU=1 runs it")
@pytest.mark.parametrize("n", os.environ.get("DETLOGP_NCU_NS", "1024 4096").split())
def test_ncu_kernel_durations(bundle, out, run, n):
    """Each kernel's duration under ncu (kernels serialised: read each one's
    duration, not their sum), one profiled run per N: the persistent split
    kernel's grid is the SM count at every N, so only the run tells its
    launches apart."""
    csv = out / f"durations_n{n}.csv"
    done = subprocess.run(
        [
            ncu(),
            "--clock-control",
            "none",
            "--metrics",
            "gpu__time_duration.sum",
            "--kernel-name",
            os.environ.get("DETLOGP_NCU_KERNELS", "regex:LinearLogp|Combine"),
            "--csv",
            "--page",
            "raw",
            *map(
                str,
                extras_bench(
                    bundle,
                    bundle.lib("liblogp_bench.so"),
                    "--kernel",
                    os.environ.get("DETLOGP_AB_KERNEL", "hopper"),
                    "--seed",
                    "8",
                    "--ns",
                    n,
                    "--reps",
                    "3",
                    "--no-torch",
                ),
            ),
        ],
        stdout=open(csv, "w"),
        stderr=open(out / f"durations_n{n}.log", "w"),
        timeout=300,
    )
    assert done.returncode == 0, f"ncu N={n}: exit {done.returncode} (log {out}/durations_n{n}.log)"
    run(
        f"durations_summary_n{n}",
        ["python3", bundle.script("kernel_durations_summary.py"), csv],
        timeout_s=60,
    )


@pytest.mark.skipif(
    os.environ.get("DETLOGP_SASS_PROFILE") != "1", reason="DETLOGP_SASS_PROFILE=1 runs it"
)
@pytest.mark.parametrize("name, top_k", [("logp", 0), ("top20", 1)])
def test_sass_profile_of_the_split_kernel(bundle, out, run, name, top_k):
    """Warp-stall samples and instructions executed per SASS instruction of
    one launch of the split kernel, logp-only and top-20
    (sass_profile_summary.py). DETLOGP_SASS_PROFILE_N (1024)."""
    report = out / f"sass_{name}"
    run(
        f"sass_profile_{name}",
        [
            ncu(),
            "--clock-control",
            "none",
            "--kernel-name-base",
            "demangled",
            "--kernel-name",
            f"regex:LinearLogpSplitKernel<.bool.0, .bool.{top_k}>",
            "--launch-skip",
            "1",
            "--launch-count",
            "1",
            "--section",
            "SourceCounters",
            "--section",
            "WarpStateStats",
            "-o",
            report,
            "-f",
            *extras_bench(
                bundle,
                bundle.lib("liblogp_bench.so"),
                "--kernel",
                "hopper",
                "--seed",
                "8",
                "--ns",
                os.environ.get("DETLOGP_SASS_PROFILE_N", "1024"),
                "--reps",
                "3",
                "--no-torch",
            ),
        ],
        timeout_s=240,
    )
    for page, extra in (
        ("sass", ["--page", "source", "--print-source", "sass"]),
        ("raw", ["--page", "raw"]),
    ):
        done = subprocess.run(
            [ncu(), "-i", f"{report}.ncu-rep", *extra, "--csv"],
            stdout=open(out / f"{name}_{page}.csv", "w"),
            timeout=120,
        )
        assert done.returncode == 0, f"ncu -i {report}.ncu-rep {page}: exit {done.returncode}"
    run(
        f"sass_summary_{name}",
        ["python3", bundle.script("sass_profile_summary.py"), out / f"{name}_sass.csv"],
        timeout_s=60,
    )
