"""2) Cancellation storm: about half the calls (unary and streaming) are
cancelled at random moments. Holds: every call not cancelled is answered with
solo-identical bits, the server keeps serving, and its RSS after the storm is
within 10% of the RSS after an equal warm-up without cancellations."""

import asyncio
import random
import time
from collections import Counter

import grpc
import grpc.aio
from detlogp import requests
from detlogp.loadgen import RowPool, cancellation_storm
from detlogp.testing import LocalServer
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

CLIENTS = 40
PHASE_S = 8.0
MAX_CALLS = 200_000


async def storm(target, pool, seconds, cancel_fraction, seed):
    return await cancellation_storm(
        target, pool, seconds, cancel_fraction, seed, clients=CLIENTS, max_calls=MAX_CALLS
    )


def test_cancellation_storm_keeps_serving_and_memory_flat(server_binary, model, report):
    with LocalServer(
        server_binary, model.flags + ["--cpu_threads=1", "--max_queue_delay_us=5000"], metrics=True
    ) as server:
        pool = RowPool.random(model.hidden, model.vocab, rows=64, seed=2)
        pool.score_solo(server.target)
        warm = asyncio.run(storm(server.target, pool, PHASE_S, 0.0, seed=1))
        time.sleep(1.0)
        rss_before = server.rss_kib()
        hits = asyncio.run(storm(server.target, pool, PHASE_S, 0.5, seed=2))
        time.sleep(1.0)
        assert server.running(), (
            f"server died during the cancellation storm (exit {server.process.poll()}); "
            f"storm outcomes {dict(hits)}; log tail:\n{server.log()[-1500:]}"
        )
        rss_after = server.rss_kib()
        after = asyncio.run(storm(server.target, pool, 2.0, 0.0, seed=3))
        metrics = server.metrics() or {}
        assert server.terminate() == 0
        stop = server.stop_counts()
    report(
        f"tried: warm-up {warm['calls']} calls without cancels, then storm of "
        f"{hits['calls']} calls from {CLIENTS} clients in {PHASE_S:.0f}s, ~50% cancelled "
        f"at a random moment in [0, 10 ms]; then {after['calls']} calls after"
    )
    report(f"storm outcomes: {dict(sorted(hits.items()))}")
    cancelled = hits["unary_cancelled"] + hits["stream_cancelled"]
    report(
        f"held: {cancelled} cancelled, rows checked {hits['rows_checked']}, "
        f"mismatched {hits['rows_mismatched']}; after-storm calls ok "
        f"{after['unary_ok'] + after['stream_ok']}/{after['calls']}; RSS before "
        f"{rss_before} KiB, after {rss_after} KiB "
        f"({100.0 * (rss_after - rss_before) / rss_before:+.1f}%); server: {stop}; "
        f"CANCELLED calls in metrics: "
        f"{sum(v for k, v in metrics.items() if 'CANCELLED' in k)}"
    )
    assert hits["calls"] > 1000 and cancelled > hits["calls"] * 0.2
    # Nothing failed that was not cancelled by us.
    unexpected = {
        k: v
        for k, v in hits.items()
        if k.startswith(("unary_", "stream_"))
        and not k.endswith(("_ok", "_cancelled", "_CANCELLED"))
    }
    assert not unexpected, unexpected
    assert hits["rows_mismatched"] == 0 and warm["rows_mismatched"] == 0
    assert after["unary_ok"] + after["stream_ok"] == after["calls"] > 0
    assert after["rows_mismatched"] == 0
    assert abs(rss_after - rss_before) <= 0.10 * rss_before


async def stream_cancel_storm(target, pool, seconds, seed):
    """Streams whose requests trickle in while the client cancels them at
    random moments: reads, jobs and cancellation race inside the server."""
    rng = random.Random(seed)
    counts = Counter()
    end = time.monotonic() + seconds
    channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
    stubs = [pb_grpc.LogProbServiceStub(c) for c in channels]

    async def client(i):
        stub = stubs[i % len(stubs)]
        while time.monotonic() < end:

            async def trickle():
                for _ in range(rng.randint(1, 6)):
                    rows = rng.sample(range(len(pool.targets)), rng.randint(1, 2))
                    yield requests.logprob_request(pool.hidden[rows], pool.targets[rows])
                    if rng.random() < 0.3:
                        await asyncio.sleep(rng.random() * 0.002)

            call = stub.StreamLogProbs(trickle())

            async def consume():
                async for _ in call:
                    counts["answers"] += 1

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(rng.random() * 0.004)
            if rng.random() < 0.6:
                call.cancel()
                counts["cancelled"] += 1
            try:
                await task
            except (grpc.RpcError, asyncio.CancelledError):
                pass
            counts["streams"] += 1

    await asyncio.gather(*[client(i) for i in range(48)])
    for channel in channels:
        await channel.close()
    return counts


def test_stream_cancellations_racing_reads_never_crash(server_binary, model, report):
    with LocalServer(server_binary, model.flags + ["--cpu_threads=1"]) as server:
        pool = RowPool.random(model.hidden, model.vocab, rows=64, seed=4)
        counts = asyncio.run(stream_cancel_storm(server.target, pool, PHASE_S, seed=5))
        report(
            f"tried: {counts['streams']} trickling streams from 48 clients in "
            f"{PHASE_S:.0f}s, {counts['cancelled']} cancelled at a random moment; "
            f"{counts['answers']} answers read"
        )
        alive = server.running()
        exit_code = server.terminate()
        report(f"held: server alive {alive}, exit code {exit_code}")
    assert counts["streams"] > 1000 and counts["cancelled"] > 0
    assert alive and exit_code == 0
