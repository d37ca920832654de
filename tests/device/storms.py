"""Cancellation storms: callers whose unary calls and streams are cancelled
at random moments, each answer that arrives checked against its rows' solo
bits; and what the server's process holds in memory between storms."""

import asyncio
import random
import time
from collections import Counter

import grpc
import grpc.aio
import numpy as np
from detlogp import requests
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

MAX_CALLS = 1_000_000


async def storm(target, pool, seconds, cancel_fraction, seed, clients=40, stream_fraction=0.5):
    """Mixed calls from `clients` coroutines for `seconds`; about
    cancel_fraction of them cancelled at a random moment in [0, 10 ms].
    Returns outcome counts (unary_ok, stream_cancelled, rows_mismatched...)."""
    counts = Counter()
    end = time.monotonic() + seconds
    channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
    stubs = [pb_grpc.LogProbServiceStub(c) for c in channels]

    def make_request(rng):
        rows = rng.sample(range(len(pool.targets)), rng.randint(1, 8))
        return rows, requests.logprob_request(
            pool.hidden[rows], pool.targets[rows], return_lse=True
        )

    def check(rows, response):
        got = np.array(response.logprobs, np.float32)
        counts["rows_checked"] += len(rows)
        counts["rows_mismatched"] += int(
            np.sum(got.view(np.uint32) != pool.solo_logp[rows].view(np.uint32))
        )

    async def client(index):
        rng = random.Random(seed * 1000 + index)
        stub = stubs[index % len(stubs)]
        while time.monotonic() < end and counts["calls"] < MAX_CALLS:
            counts["calls"] += 1
            cancel = rng.random() < cancel_fraction
            delay = rng.uniform(0, 0.01)
            if rng.random() >= stream_fraction:
                rows, request = make_request(rng)
                call = stub.ComputeLogProbs(request, timeout=30)
                if cancel:
                    await asyncio.sleep(delay)
                    call.cancel()
                try:
                    check(rows, await call)
                    counts["unary_ok"] += 1
                except asyncio.CancelledError:
                    counts["unary_cancelled"] += 1
                except grpc.RpcError as error:
                    counts[f"unary_{error.code().name}"] += 1
            else:
                batch = [make_request(rng) for _ in range(rng.randint(1, 5))]
                call = stub.StreamLogProbs(timeout=30)
                try:
                    for _, request in batch:
                        await call.write(request)
                    await call.done_writing()
                    if cancel:
                        await asyncio.sleep(delay)
                        call.cancel()
                    answered = 0
                    async for response in call:
                        check(batch[answered][0], response)
                        answered += 1
                    counts["stream_ok" if answered == len(batch) else "stream_short"] += 1
                except asyncio.CancelledError:
                    counts["stream_cancelled"] += 1
                except grpc.RpcError as error:
                    counts[f"stream_{error.code().name}"] += 1
                except grpc.aio.UsageError:  # write after our own cancel
                    counts["stream_cancelled"] += 1

    await asyncio.gather(*[client(i) for i in range(clients)])
    for channel in channels:
        await channel.close()
    return counts


def unexpected_outcomes(counts):
    """Outcomes other than answered or cancelled by the caller."""
    return {
        k: v
        for k, v in counts.items()
        if k.startswith(("unary_", "stream_"))
        and not k.endswith(("_ok", "_cancelled", "_CANCELLED"))
    }


def process_memory_kib(pid):
    """VmRSS and its parts (RssAnon: heap and anonymous maps; RssFile:
    mapped files and libraries; RssShmem), KiB, from /proc/PID/status."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                found[key] = int(value.split()[0])
    return found


def last_third_growth(rss):
    """(growth, start, peak): the largest RSS over the last third of the
    storms against the RSS after the storm just before that third, as a
    fraction of the latter."""
    third = max(1, len(rss) // 3)
    start = rss[-third - 1]
    peak = max(rss[-third:])
    return (peak - start) / start, start, peak
