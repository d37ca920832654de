"""Checks and loads the serving suites share: bits over gRPC under
concurrent callers, closed-loop throughput (serve_throughput's JSON line),
and seeded rows scored exactly."""

import time
import urllib.request

import numpy as np


def check_invariance(run, bundle, target, name="invariance", extras=(), probes=32, callers=64):
    """detlogp_cli check-invariance: probes alone vs mixed into concurrent
    callers; its exit code is the verdict."""
    run(
        name,
        [
            bundle.cli,
            "check-invariance",
            f"--target={target}",
            f"--probes={probes}",
            f"--concurrency={callers}",
            "--calls_per_thread=4",
            "--channels=8",
            *extras,
        ],
        timeout_s=300,
    )


def throughput(run, bundle, target, name, rows, callers, channels, seconds, warmup_s=2.0, extra=()):
    """serve_throughput's figures (rows_per_s, p50_ms, ...); fails on any
    error or wrong answer."""
    result = run(
        name,
        [
            bundle.bin("serve_throughput"),
            f"--target={target}",
            f"--rows={rows}",
            f"--callers={callers}",
            f"--channels={channels}",
            f"--seconds={seconds}",
            f"--warmup_seconds={warmup_s}",
            *extra,
        ],
        timeout_s=seconds + warmup_s + 120,
        json_path="stdout",
    )
    assert result["errors"] == 0 and result["bad_answers"] == 0, f"{name}: {result}"
    return result


def seeded_scores(target, rows=512, seed=42, hidden=4096, vocab=151936):
    """(logprobs, lse, determinism_key) of seeded random rows."""
    import detlogp

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    targets = rng.integers(0, vocab, rows)
    with detlogp.Client(target, timeout=120.0) as client:
        result = client.logprobs(x, targets, return_lse=True)
    return result.logprobs, result.lse, result.determinism_key


def same_bits(a, b):
    """Two seeded_scores answers hold the same bits and key."""
    return (
        a[2] == b[2]
        and np.array_equal(a[0].view(np.uint32), b[0].view(np.uint32))
        and np.array_equal(a[1].view(np.uint32), b[1].view(np.uint32))
    )


def scrape(server):
    """The server's Prometheus text (its --metrics_port)."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def where_time_went(run, bundle, server, out, name, phase):
    """Runs phase() between two scrapes of the server's metrics and logs
    where the server's time went (metrics_delta.py, out/NAME.log); returns
    phase()'s result."""
    before, after = out / f"{name}_metrics_before.txt", out / f"{name}_metrics_after.txt"
    before.write_text(scrape(server))
    start = time.monotonic()
    result = phase()
    seconds = time.monotonic() - start
    after.write_text(scrape(server))
    run(name, ["python3", bundle.script("metrics_delta.py"), before, after, seconds], timeout_s=60)
    return result
