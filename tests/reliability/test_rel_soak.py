"""1) Soak: 200+ concurrent clients, unary and streaming mixed, for 60 s.
Holds: every request answered exactly once (none lost, none duplicated,
streams in order), 100% of rows bit-identical to the row computed alone, one
determinism key, no call failed, and the server's own row count agrees."""

import asyncio

from detlogp.loadgen import LoadConfig, RowPool, run_load
from detlogp.testing import LocalServer

CLIENTS = 200


def test_soak_200_clients_mixed_unary_and_streaming(server_binary, model, soak_seconds, report):
    with LocalServer(server_binary, model.flags + ["--cpu_threads=1"]) as server:
        pool = RowPool.random(model.hidden, model.vocab, rows=64, seed=1)
        pool.score_solo(server.target)
        config = LoadConfig(
            targets=[server.target],
            clients=CLIENTS,
            duration_s=soak_seconds,
            max_requests=2_000_000,
            stream_fraction=0.5,
            stream_requests=(1, 5),
            rows=(1, 8),
            think_s=(0.05, 0.2),
            timeout_s=60.0,
            seed=1,
        )
        result = asyncio.run(run_load(config, pool))
        rss_kib = server.rss_kib()
        assert server.terminate() == 0
        stop = server.stop_counts()
    s = result.summary()
    report(
        f"tried: {CLIENTS} clients (one channel each) for {soak_seconds:.0f}s, "
        f"{s['unary_calls']} unary calls + {s['stream_calls']} streams, "
        f"{s['requests_sent']} requests, 1-8 rows each"
    )
    report(
        f"held: {s['answers']} answered, lost {s['lost']}, duplicated {s['duplicated']}, "
        f"out of order {s['out_of_order']}, errors {s['errors']}; rows checked "
        f"{s['rows_checked']}, bit mismatches {s['rows_mismatched']}, key mismatches "
        f"{s['key_mismatches']}"
    )
    report(
        f"rate: {s['requests_per_s']} req/s, {s['rows_per_s']} rows/s, latency ms "
        f"{s['latency_ms']}; server RSS {rss_kib} KiB; server stop line {stop}"
    )
    assert result.wall_s >= soak_seconds * 0.95
    assert result.requests_sent > 0 and result.answers == result.requests_sent
    assert result.lost == 0 and result.duplicated == 0 and result.out_of_order == 0
    assert not result.errors
    assert result.rows_mismatched == 0 and result.key_mismatches == 0
    assert result.rows_checked == result.rows_answered
    # The server computed every answered row once, plus the solo pool and its
    # warm-up batch: nothing computed twice, nothing dropped.
    solo = len(pool.targets)
    assert stop is not None
    warmup = stop["computed"] - result.rows_answered - solo
    report(
        f"server rows computed {stop['computed']} = answered {result.rows_answered} "
        f"+ solo {solo} + warm-up {warmup}"
    )
    assert 0 <= warmup <= 256
    assert stop["expired"] == stop["cancelled"] == stop["rejected"] == 0
