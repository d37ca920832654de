"""serve: the server on cuda:0 (H=4096, V=151936). Bits over gRPC with and
without extras under 64 concurrent callers, the Python load generator with
extras mixed in, throughput (N=256 x 64 callers), small-call latency (16
rows from 8 callers and from one, one row), the projection's bits from the
GPU equal the CPU's, and the kernel alone at the same batch sizes. On a
Hopper GPU the 256 x 64 throughput and the 16 x 8 median latency are gated
(gates.py). Each load phase logs where the server's time went
(metrics_delta.py).

DETLOGP_SERVE_SWEEP="threads:delay_us:rows[:spin_us[:qos]] ..." compares
server settings; with two or more GPUs (DETLOGP_MULTI_GPU=0 skips): GPU 0 ==
GPU 1 == cuda:all == --vocab_parallel bits, throughput, versions uploaded
under load. Figures go to <device_out>/serve/figures.json.
"""

import contextlib
import os
import struct

import gates
import numpy as np
import pytest
from gpu import gpus
from models import SYNTHETIC_MODEL
from serving_checks import (
    check_invariance,
    same_bits,
    seeded_scores,
    throughput,
    where_time_went,
)

pytestmark = pytest.mark.serve

SECONDS = float(os.environ.get("DETLOGP_SERVE_SECONDS", "10"))
LATENCY_SECONDS = float(os.environ.get("DETLOGP_LATENCY_SECONDS", "5"))
LOAD_SECONDS = float(os.environ.get("DETLOGP_LOAD_SECONDS", "15"))
SWEEP = os.environ.get("DETLOGP_SERVE_SWEEP", "").split()
PROJECTION_ROWS = 37296


@pytest.fixture(scope="module")
def gpu_server(serving):
    with serving(
        "gpu",
        "--device=cuda:0",
        *SYNTHETIC_MODEL,
        f"--max_batch_rows={os.environ.get('DETLOGP_MAX_BATCH_ROWS', '4096')}",
        f"--max_queue_delay_us={os.environ.get('DETLOGP_QUEUE_DELAY_US', '0')}",
        "--max_queue_rows=262144",
    ) as server:
        yield server


@pytest.mark.parametrize("extras", [[], ["--entropy", "--top_k=20"]], ids=["logp", "extras"])
def test_bits_under_concurrent_callers(bundle, gpu_server, run, extras):
    check_invariance(
        run, bundle, gpu_server.target, "invariance" + "_extras" * bool(extras), extras
    )


def test_python_load_generator_with_extras(bundle, gpu_server, run, out, figures):
    report = out / "load_extras.json"
    result = run(
        "detlogp_load",
        [
            "python3",
            bundle.script("detlogp_load.py"),
            "--target",
            gpu_server.target,
            "--clients",
            "32",
            "--channels",
            "8",
            "--duration",
            LOAD_SECONDS,
            "--json_out",
            report,
        ],
        timeout_s=LOAD_SECONDS + 120,
        json_path=report,
    )
    figures["load_requests_per_s"] = result.get("requests_per_s")


@pytest.mark.parametrize(
    "rows, callers, channels, seconds",
    [(256, 64, 16, SECONDS), (16, 8, 8, LATENCY_SECONDS), (16, 1, 1, 3.0), (1, 1, 1, 3.0)],
    ids=["256x64", "16x8", "16x1", "1x1"],
)
def test_throughput_and_latency(
    bundle, gpu, gpu_server, run, out, figures, rows, callers, channels, seconds
):
    name = f"throughput_{rows}x{callers}"
    result = where_time_went(
        run,
        bundle,
        gpu_server,
        out,
        f"server_time_{rows}x{callers}",
        lambda: throughput(run, bundle, gpu_server.target, name, rows, callers, channels, seconds),
    )
    figures[f"{rows}x{callers}"] = {
        k: result[k] for k in ("rows_per_s", "p50_ms", "p90_ms", "p99_ms", "calls")
    }
    print(f"{name}: {result}")
    if not gpu.is_hopper:
        return
    if (rows, callers) == (256, 64):
        gates.at_least(
            "serve 256 x 64 rows/s", result["rows_per_s"], gates.SERVE_256X64_ROWS_PER_S_MIN
        )
    elif (rows, callers) == (16, 8):
        gates.at_most("serve 16 x 8 p50", result["p50_ms"], gates.SERVE_16X8_P50_MS_MAX, " ms")


def project_seeded(target, rows, seed=7):
    import detlogp

    x = np.random.default_rng(seed).standard_normal((rows, 96), dtype=np.float32)
    with detlogp.Client(target, timeout=300.0) as client:
        return client.project(x)


def test_projection_gpu_bits_equal_cpu(serving, gpu_server):
    gpu = project_seeded(gpu_server.target, PROJECTION_ROWS)
    with serving("cpu", "--device=cpu") as cpu_server:
        cpu = project_seeded(cpu_server.target, PROJECTION_ROWS)
    assert gpu.determinism_key == cpu.determinism_key, (gpu.determinism_key, cpu.determinism_key)
    assert gpu.y.shape == cpu.y.shape
    differing = int(np.sum(gpu.y.view(np.uint32) != cpu.y.view(np.uint32)))
    assert differing == 0, f"projection: {differing} of {gpu.y.size} values differ GPU vs CPU"


def test_kernel_alone_at_the_same_batch_sizes(bundle, out, run, figures):
    report = out / "kernel_only.json"
    result = run(
        "kernel_only",
        [
            "python3",
            bundle.script("logp_bench.py"),
            "--lib",
            bundle.lib("liblogp_bench.so"),
            "--ns",
            "16,256,2048,4096",
            "--reps",
            "20",
            "--no-torch",
            "--json",
            report,
        ],
        timeout_s=300,
        json_path=report,
    )
    figures["kernel_only_ms"] = {row["n"]: row["invariant_ms"] for row in result["rows"]}


@contextlib.contextmanager
def cpu_dma_latency_zero():
    """Holds /dev/cpu_dma_latency at 0 (no deep CPU sleep states)."""
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    try:
        os.write(fd, struct.pack("i", 0))
        yield
    finally:
        os.close(fd)


@pytest.mark.skipif(not SWEEP, reason='DETLOGP_SERVE_SWEEP="threads:delay_us:rows ..." runs it')
@pytest.mark.parametrize("config", SWEEP)
def test_sweep_server_settings(bundle, serving, run, figures, config):
    threads, delay, rows, spin, qos = (config.split(":") + ["", ""])[:5]
    hold = cpu_dma_latency_zero() if qos == "qos" else contextlib.nullcontext()
    with (
        hold,
        serving(
            f"sweep_{config.replace(':', '_')}",
            "--device=cuda:0",
            *SYNTHETIC_MODEL,
            f"--batch_threads={threads}",
            f"--max_queue_delay_us={delay}",
            f"--max_batch_rows={rows}",
            "--max_queue_rows=262144",
            f"--batch_spin_us={spin or -1}",
        ) as server,
    ):
        found = {}
        if os.environ.get("DETLOGP_SWEEP_LARGE", "1") != "0":
            found["256x64"] = throughput(run, bundle, server.target, "sweep_256x64", 256, 64, 16, 8)
        found["16x8"] = throughput(run, bundle, server.target, "sweep_16x8", 16, 8, 8, 4, 1)
        found["16x1"] = throughput(run, bundle, server.target, "sweep_16x1", 16, 1, 1, 3, 1)
    figures[f"sweep {config}"] = {k: (v["rows_per_s"], v["p50_ms"]) for k, v in found.items()}


MULTI_GPU = len(gpus()) >= 2 and os.environ.get("DETLOGP_MULTI_GPU", "1") != "0"
multi_gpu = pytest.mark.skipif(not MULTI_GPU, reason="needs two GPUs (DETLOGP_MULTI_GPU=0 skips)")
MULTI_MODEL = [
    *SYNTHETIC_MODEL,
    "--max_queue_rows=262144",
    "--max_batch_rows=4096",
    "--max_queue_delay_us=0",
]


def swap_under_load(run, bundle, target, name):
    """A new 1.24 GB version every 2 s for 8 s while 64 callers score."""
    result = run(
        name,
        [
            bundle.bin("swap_under_load"),
            f"--target={target}",
            "--callers=64",
            "--channels=16",
            "--rows=256",
            "--steady_seconds=3",
            "--swap_seconds=8",
            "--swap_every_seconds=2",
        ],
        timeout_s=300,
        json_path="stdout",
    )
    assert result["failed_pushes"] == 0 and result["failed_calls"] == 0, result
    assert result["answers_differing"] == 0 and result["solo_rows_differing"] == 0, result


@multi_gpu
def test_multi_gpu_same_bits_everywhere(bundle, serving, run, figures):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    with (
        serving("gpu0", "--device=cuda:0", *MULTI_MODEL) as gpu0,
        serving("gpu1", "--device=cuda:1", *MULTI_MODEL) as gpu1,
    ):
        reference = seeded_scores(gpu0.target)
        assert same_bits(reference, seeded_scores(gpu1.target)), "GPU 1 vs GPU 0"
        figures["one_gpu_256x64"] = throughput(run, bundle, gpu0.target, "one_gpu", 256, 64, 16, 6)
    for name, flags in (("all", []), ("vocab", ["--vocab_parallel"])):
        with serving(
            name, "--device=cuda:all", *flags, "--max_versions_per_model=16", *MULTI_MODEL
        ) as server:
            assert same_bits(reference, seeded_scores(server.target)), f"{name} vs GPU 0"
            check_invariance(
                run, bundle, server.target, f"invariance_{name}", probes=16, callers=32
            )
            figures[f"{name}_256x64"] = throughput(
                run, bundle, server.target, f"throughput_{name}", 256, 64, 16, 6
            )
            swap_under_load(run, bundle, server.target, f"swap_{name}")
