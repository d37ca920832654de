"""soak: cancellation storms against a GPU server (cuda:0, H=4096,
V=151936). After a warm-up without cancels, DETLOGP_SOAK_STORMS storms
(30) of DETLOGP_SOAK_STORM_S seconds (3) each (DETLOGP_SOAK_DEVICE=cpu:
against a CPU server): 40 callers, unary and
streaming mixed, about half the calls cancelled at a random moment in
[0, 10 ms]. The server's RSS (and its anonymous, file and shared parts,
and the server's memory gauges) is read after each storm.

Holds: every answer that arrives has its rows' solo bits, nothing fails
that the caller did not cancel, the server serves every call after the
storms and exits 0, and its memory is flat: over the last third of the
storms RSS grows by at most gates.SOAK_LAST_THIRD_RSS_GROWTH_MAX of its
level at the start of that third. Every reading goes to
<device_out>/soak/soak.json."""

import asyncio
import json
import os
import time

import gates
import pytest
from detlogp.loadgen import cancellation_storm as storm
from models import SYNTHETIC_MODEL
from storms import last_third_growth, process_memory_kib, unexpected_outcomes

pytestmark = pytest.mark.soak

STORMS = int(os.environ.get("DETLOGP_SOAK_STORMS", "30"))
STORM_S = float(os.environ.get("DETLOGP_SOAK_STORM_S", "3"))
DEVICE = os.environ.get("DETLOGP_SOAK_DEVICE", "cuda:0")
SETTLE_S = 0.5  # after a storm, before reading memory
MEMORY_GAUGES = ("detlogp_model_memory_bytes", "detlogp_device_memory_used_bytes")


def gauges(server):
    samples = server.metrics() or {}
    return {k: v for k, v in samples.items() if k.startswith(MEMORY_GAUGES)}


def test_cancellation_storms_keep_serving_and_memory_flat(serving, out, figures):
    from detlogp.loadgen import RowPool

    readings = []
    with serving(
        "soak", f"--device={DEVICE}", *SYNTHETIC_MODEL, "--max_queue_rows=262144"
    ) as server:
        pool = RowPool.random(4096, 151936, rows=64, seed=2)
        pool.score_solo(server.target)
        warm = asyncio.run(storm(server.target, pool, STORM_S, 0.0, seed=1))
        time.sleep(SETTLE_S)
        readings.append({"storm": 0, **process_memory_kib(server.pid), **gauges(server)})
        totals = warm.copy()
        for index in range(1, STORMS + 1):
            counts = asyncio.run(storm(server.target, pool, STORM_S, 0.5, seed=index + 1))
            time.sleep(SETTLE_S)
            assert server.running(), (
                f"server died in storm {index} (exit {server.process.poll()}); "
                f"outcomes {dict(counts)}; log tail:\n{server.log()[-1500:]}"
            )
            reading = {"storm": index, "calls": counts["calls"], **process_memory_kib(server.pid)}
            readings.append({**reading, **gauges(server)})
            print(f"storm {index}: {dict(sorted(counts.items()))}; memory {reading}")
            totals.update(counts)
        after = asyncio.run(storm(server.target, pool, 2.0, 0.0, seed=STORMS + 2))
        exit_code = server.terminate()
        stop = server.stop_counts()
    rss = [r["VmRSS"] for r in readings[1:]]
    growth, start, peak = last_third_growth(rss)
    verdict = {
        "storms": STORMS,
        "storm_s": STORM_S,
        "calls": totals["calls"],
        "cancelled": totals["unary_cancelled"] + totals["stream_cancelled"],
        "rows_checked": totals["rows_checked"],
        "rss_warm_kib": readings[0]["VmRSS"],
        "rss_last_third_start_kib": start,
        "rss_last_third_peak_kib": peak,
        "rss_last_kib": rss[-1],
        "last_third_growth": growth,
        "server_stop": stop,
        "readings": readings,
    }
    (out / "soak.json").write_text(json.dumps(verdict, indent=1) + "\n")
    figures.update({k: v for k, v in verdict.items() if k != "readings"})
    print(
        f"RSS warm {readings[0]['VmRSS'] / 1024:.0f} MiB; after storms 1..{STORMS}: "
        + " ".join(f"{r / 1024:.0f}" for r in rss)
        + f" MiB; last third {100 * growth:+.2f}%"
    )
    assert totals["calls"] > 1000 and verdict["cancelled"] > totals["calls"] * 0.2, totals
    assert not unexpected_outcomes(totals), unexpected_outcomes(totals)
    assert totals["rows_mismatched"] == 0, totals
    assert after["unary_ok"] + after["stream_ok"] == after["calls"] > 0, after
    assert after["rows_mismatched"] == 0, after
    assert exit_code == 0, f"server exit code {exit_code}"
    gates.at_most(
        f"RSS growth over the last {max(1, STORMS // 3)} of {STORMS} cancellation storms",
        100 * growth,
        100 * gates.SOAK_LAST_THIRD_RSS_GROWTH_MAX,
        unit="%",
    )
