"""An asyncio load generator that checks every answer's bits.

A pool of rows is scored alone first (the "solo" bits). Then `clients`
concurrent callers, each on its own channel, send unary and streaming calls
made of random pool rows, for a bounded time and count, either as fast as
they can (closed loop, optional think time) or at a fixed total request rate
(open loop). Every answer is checked: exactly one per request, ids echoed in
order, every row's bits equal to its solo bits, the determinism key equal.

Requests may also ask for entropy and top-k log-probs, mixed
freely (LoadConfig.extras): the pool is then scored alone with entropy and
the largest top-k, and every answered row's entropy must have its solo bits
and its top-k list must be the first k of its solo list, bit for bit, ids
and log-probs; log p(target) and lse must keep their bits whatever else was
asked for.

    pool = RowPool.random(client_info, rows=64, seed=0)
    pool.score_solo(target, entropy=True, top_k=20)
    config = LoadConfig(targets=[target], extras=extras_mix(20))
    report = asyncio.run(run_load(config, pool))
    print(report.table()); json.dumps(report.summary())
"""

import asyncio
import dataclasses
import random
import time
from collections import Counter
from typing import List, Optional

import grpc
import grpc.aio
import numpy as np

from detlogp import requests as requests_module
from detlogp.aio import AsyncClient
from detlogp.client import Client
from detlogp.errors import DetlogpError
from detlogp.retry import NO_RETRY
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

# What a request asks for beyond log p(target) and lse: (return_entropy, top_k).
NEITHER = (False, 0)


def extras_mix(max_top_k=20):
    """Requests with entropy, top-k of several sizes, both, or neither, in
    about equal shares (max_top_k: the largest k, at most the server's
    --max_top_k)."""
    ks = sorted({k for k in (1, 5, max_top_k) if 0 < k <= max_top_k})
    return (NEITHER, (True, 0)) + tuple((False, k) for k in ks) + tuple((True, k) for k in ks)


@dataclasses.dataclass
class RowPool:
    """Rows to draw requests from, with each row's solo answer bits."""

    hidden: np.ndarray
    targets: np.ndarray
    solo_logp: Optional[np.ndarray] = None  # float32 per row
    solo_lse: Optional[np.ndarray] = None
    key: str = ""
    # With score_solo(entropy=True, top_k=K): float32 [P], int64 [P, K],
    # float32 [P, K].
    solo_entropy: Optional[np.ndarray] = None
    solo_top_ids: Optional[np.ndarray] = None
    solo_top_logprobs: Optional[np.ndarray] = None

    @classmethod
    def random(cls, hidden_size, vocab_size, rows=64, seed=0):
        rng = np.random.default_rng(seed)
        return cls(
            rng.standard_normal((rows, hidden_size)).astype(np.float32),
            rng.integers(0, vocab_size, size=rows),
        )

    @property
    def solo_top_k(self):
        """The k of the solo top-k lists (0: none)."""
        return 0 if self.solo_top_ids is None else self.solo_top_ids.shape[1]

    def score_solo(self, target, timeout=60.0, *, entropy=False, top_k=0):
        """Scores every row alone (N=1), sequentially, on one target, with
        lse (and entropy, and the top_k largest, when asked). Called again
        for another target, it checks that target gives the same bits and
        key (ValueError otherwise)."""
        logp, lse, ent, ids, top = [], [], [], [], []
        key = ""
        with Client(target, timeout=timeout) as client:
            for i in range(len(self.targets)):
                r = client.logprobs(
                    self.hidden[i : i + 1],
                    self.targets[i : i + 1],
                    return_lse=True,
                    return_entropy=entropy,
                    top_k=top_k,
                )
                logp.append(r.logprobs[0])
                lse.append(r.lse[0])
                if entropy:
                    ent.append(r.entropy[0])
                if top_k:
                    ids.append(r.top_ids[0])
                    top.append(r.top_logprobs[0])
                key = r.determinism_key
        scored = dict(
            solo_logp=np.array(logp, np.float32),
            solo_lse=np.array(lse, np.float32),
            solo_entropy=np.array(ent, np.float32) if entropy else None,
            solo_top_ids=np.array(ids, np.int64).reshape(-1, top_k) if top_k else None,
            solo_top_logprobs=(np.array(top, np.float32).reshape(-1, top_k) if top_k else None),
        )
        if self.solo_logp is not None:  # another target: the same bits
            differ = [
                name for name, value in scored.items() if _bits(value) != _bits(getattr(self, name))
            ]
            if key != self.key:
                differ.append("determinism_key")
            if differ:
                raise ValueError(
                    f"{target} scores the pool's rows with other bits "
                    f"than the first target ({', '.join(differ)})"
                )
        self.key = key
        for name, value in scored.items():
            setattr(self, name, value)


def _bits(array):
    return None if array is None else np.ascontiguousarray(array).tobytes()


@dataclasses.dataclass
class LoadConfig:
    targets: List[str]
    clients: int = 200  # concurrent callers, one channel each
    duration_s: float = 60.0  # stop issuing after this long
    max_requests: int = 1_000_000  # and after this many requests
    rate: Optional[float] = (
        None  # calls started/s in all (open loop; a stream is one call); None: closed loop
    )
    stream_fraction: float = 0.5  # share of calls that are streams
    stream_requests: tuple = (1, 5)  # requests per stream, inclusive
    rows: tuple = (1, 8)  # rows per request, inclusive
    think_s: tuple = (0.0, 0.0)  # closed loop: pause between calls
    timeout_s: float = 30.0  # per call
    channels: Optional[int] = None  # shared channels; None: one per client
    seed: int = 0
    # (return_entropy, top_k) choices, drawn uniformly per request; the pool
    # must be scored alone with entropy / a top_k at least the largest here.
    extras: tuple = (NEITHER,)


@dataclasses.dataclass
class LoadReport:
    requests_sent: int = 0
    answers: int = 0
    rows_answered: int = 0
    rows_checked: int = 0
    rows_mismatched: int = 0
    key_mismatches: int = 0
    lost: int = 0  # sent, never answered, no error either
    duplicated: int = 0  # answered more than once
    out_of_order: int = 0  # stream answers whose id was not the next one
    # Rows checked and mismatched per output ("logprob", "lse", "entropy",
    # "top_k"); requests per (return_entropy, top_k) asked for.
    checked_by_output: Counter = dataclasses.field(default_factory=Counter)
    mismatched_by_output: Counter = dataclasses.field(default_factory=Counter)
    requests_by_extras: Counter = dataclasses.field(default_factory=Counter)
    errors: Counter = dataclasses.field(default_factory=Counter)
    unary_calls: int = 0
    stream_calls: int = 0
    latencies_s: list = dataclasses.field(default_factory=list)
    wall_s: float = 0.0

    def summary(self):
        lat = np.array(self.latencies_s) * 1e3 if self.latencies_s else np.zeros(1)
        pct = lambda q: round(float(np.percentile(lat, q)), 3)
        wall = max(self.wall_s, 1e-9)
        return {
            "wall_s": round(self.wall_s, 3),
            "requests_sent": self.requests_sent,
            "answers": self.answers,
            "unary_calls": self.unary_calls,
            "stream_calls": self.stream_calls,
            "requests_per_s": round(self.answers / wall, 1),
            "rows_per_s": round(self.rows_answered / wall, 1),
            "latency_ms": {
                "p50": pct(50),
                "p90": pct(90),
                "p99": pct(99),
                "max": round(float(lat.max()), 3),
            },
            "rows_checked": self.rows_checked,
            "rows_mismatched": self.rows_mismatched,
            "key_mismatches": self.key_mismatches,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "out_of_order": self.out_of_order,
            "rows_checked_by_output": dict(self.checked_by_output),
            "rows_mismatched_by_output": dict(self.mismatched_by_output),
            "requests_by_extras": {
                f"entropy={int(e)},top_k={k}": n
                for (e, k), n in sorted(self.requests_by_extras.items())
            },
            "errors": dict(self.errors),
        }

    def table(self):
        s = self.summary()
        lat = s["latency_ms"]
        return "\n".join(
            [
                f"{'requests/s':>12} {'rows/s':>10} {'p50 ms':>8} {'p90 ms':>8} "
                f"{'p99 ms':>8} {'max ms':>8}",
                f"{s['requests_per_s']:>12} {s['rows_per_s']:>10} {lat['p50']:>8} "
                f"{lat['p90']:>8} {lat['p99']:>8} {lat['max']:>8}",
                f"answers {s['answers']}/{s['requests_sent']} sent "
                f"({s['unary_calls']} unary calls, {s['stream_calls']} streams), "
                f"rows checked {s['rows_checked']}, mismatched {s['rows_mismatched']}, "
                f"lost {s['lost']}, duplicated {s['duplicated']}, errors {s['errors']}",
                f"rows checked by output {s['rows_checked_by_output']}, "
                f"mismatched {s['rows_mismatched_by_output']}",
            ]
        )


class _Caller:
    """One client: builds requests from the pool and checks the answers."""

    def __init__(self, index, client, pool, config, report, budget):
        self.index = index
        self.client = client
        self.pool = pool
        self.config = config
        self.report = report
        self.budget = budget
        self.rng = random.Random(config.seed * 100003 + index)
        self.seq = 0

    def _new_request(self):
        rows = self.rng.sample(range(len(self.pool.targets)), self.rng.randint(*self.config.rows))
        extras = self.rng.choice(self.config.extras)
        request_id = f"c{self.index}-{self.seq}"
        self.seq += 1
        self.report.requests_sent += 1
        self.report.requests_by_extras[extras] += 1
        return request_id, rows, extras

    def _check(self, request_id, rows, extras, answer, sent_at, answered):
        report = self.report
        report.latencies_s.append(time.monotonic() - sent_at)
        if answered.get(request_id):
            report.duplicated += 1
        answered[request_id] = answered.get(request_id, 0) + 1
        report.answers += 1
        report.rows_answered += len(rows)
        if answer.determinism_key != self.pool.key:
            report.key_mismatches += 1
        report.rows_checked += len(rows)
        bad = _row_mismatches(self.pool, rows, extras, answer, report)
        report.rows_mismatched += int(bad.sum())

    async def unary(self):
        request_id, rows, extras = self._new_request()
        self.report.unary_calls += 1
        sent_at = time.monotonic()
        answered = {}
        try:
            answer = await self.client.logprobs(
                self.pool.hidden[rows],
                self.pool.targets[rows],
                return_lse=True,
                return_entropy=extras[0],
                top_k=extras[1],
                request_id=request_id,
                timeout=self.config.timeout_s,
            )
        except DetlogpError as error:
            self.report.errors[error.code.name if error.code else "CLIENT"] += 1
            return
        if answer.request_id != request_id:
            self.report.out_of_order += 1
        self._check(request_id, rows, extras, answer, sent_at, answered)

    async def stream(self):
        count = self.rng.randint(*self.config.stream_requests)
        count = max(1, min(count, self.budget.take(count - 1) + 1))
        self.report.stream_calls += 1
        sent = []  # (request_id, rows, extras, sent_at) in order
        answered = {}

        def items():
            for _ in range(count):
                request_id, rows, extras = self._new_request()
                sent.append((request_id, rows, extras, time.monotonic()))
                yield dict(
                    hidden=self.pool.hidden[rows],
                    targets=self.pool.targets[rows],
                    return_lse=True,
                    return_entropy=extras[0],
                    top_k=extras[1],
                    request_id=request_id,
                )

        got = 0
        try:
            async for answer in self.client.stream(items(), timeout=self.config.timeout_s):
                if got >= len(sent) or answer.request_id != sent[got][0]:
                    self.report.out_of_order += 1
                    match = [s for s in sent if s[0] == answer.request_id]
                    if not match:
                        continue
                    request_id, rows, extras, sent_at = match[0]
                else:
                    request_id, rows, extras, sent_at = sent[got]
                self._check(request_id, rows, extras, answer, sent_at, answered)
                got += 1
        except DetlogpError as error:
            self.report.errors[error.code.name if error.code else "CLIENT"] += 1
            return
        self.report.lost += sum(1 for s in sent if s[0] not in answered)


def _row_mismatches(pool, rows, extras, answer, report):
    """Bool [len(rows)]: rows whose logprob, lse, entropy or top-k bits
    differ from their solo bits (top-k: the solo list's first k), or that
    hold an output not asked for. Counts per output go into `report`."""
    n = len(rows)
    entropy, k = extras
    bad = np.zeros(n, bool)

    def compare(output, got, want):  # float32 [n] each
        report.checked_by_output[output] += n
        if got is None or got.shape != want.shape:
            differ = np.ones(n, bool)
        else:
            differ = got.view(np.uint32) != want.view(np.uint32)
        report.mismatched_by_output[output] += int(np.sum(differ))
        bad[:] |= differ

    compare("logprob", answer.logprobs, pool.solo_logp[rows])
    compare("lse", answer.lse, pool.solo_lse[rows])
    if entropy:
        compare("entropy", answer.entropy, pool.solo_entropy[rows])
    elif answer.entropy is not None:
        bad[:] = True
    if k:
        got_ids, got_lp = answer.top_ids, answer.top_logprobs
        want_ids = pool.solo_top_ids[rows, :k]
        want_lp = pool.solo_top_logprobs[rows, :k]
        report.checked_by_output["top_k"] += n
        if (
            got_ids is None
            or got_lp is None
            or got_ids.shape != want_ids.shape
            or got_lp.shape != want_lp.shape
        ):
            differ = np.ones(n, bool)
        else:
            differ = np.any(got_ids != want_ids, axis=1) | np.any(
                got_lp.view(np.uint32) != want_lp.view(np.uint32), axis=1
            )
        report.mismatched_by_output["top_k"] += int(np.sum(differ))
        bad |= differ
    elif answer.top_ids is not None or answer.top_logprobs is not None:
        bad[:] = True
    return bad


class _Budget:
    """Shared request count and end time."""

    def __init__(self, max_requests, end):
        self.left = max_requests
        self.end = end

    def take(self, n=1):
        """Takes up to n requests; returns how many were granted."""
        if time.monotonic() >= self.end:
            return 0
        granted = max(0, min(n, self.left))
        self.left -= granted
        return granted


async def run_load(config, pool):
    """Runs the load described by `config` against `pool`; a LoadReport."""
    if pool.solo_logp is None:
        raise ValueError("pool.score_solo(target) first")
    if any(e for e, _ in config.extras) and pool.solo_entropy is None:
        raise ValueError(
            "config.extras ask for entropy: pool.score_solo(target, entropy=True) first"
        )
    max_k = max(k for _, k in config.extras)
    if max_k > pool.solo_top_k:
        raise ValueError(
            f"config.extras ask for top_k={max_k}: pool.score_solo(target, top_k={max_k}) first"
        )
    report = LoadReport()
    n_channels = config.channels or config.clients
    clients = [
        AsyncClient(config.targets, timeout=config.timeout_s, retry=NO_RETRY)
        for _ in range(n_channels)
    ]
    began = time.monotonic()
    budget = _Budget(config.max_requests, began + config.duration_s)
    callers = [
        _Caller(i, clients[i % n_channels], pool, config, report, budget)
        for i in range(config.clients)
    ]

    async def one_call(caller):
        if caller.rng.random() < config.stream_fraction:
            await caller.stream()
        else:
            await caller.unary()

    async def closed_loop(caller):
        while budget.take(1):
            await one_call(caller)
            if config.think_s[1] > 0:
                await asyncio.sleep(caller.rng.uniform(*config.think_s))

    async def open_loop():
        interval = 1.0 / config.rate
        in_flight = set()
        next_at = time.monotonic()
        i = 0
        while budget.take(1):
            caller = callers[i % len(callers)]
            i += 1
            if len(in_flight) >= config.clients:  # bounded concurrency
                _, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.ensure_future(one_call(caller))
            in_flight.add(task)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if in_flight:
            await asyncio.wait(in_flight)

    try:
        if config.rate:
            await open_loop()
        else:
            await asyncio.gather(*[closed_loop(c) for c in callers])
    finally:
        report.wall_s = time.monotonic() - began
        for client in clients:
            await client.close()
    return report


async def cancellation_storm(
    target,
    pool,
    seconds,
    cancel_fraction,
    seed,
    clients=40,
    stream_fraction=0.5,
    max_calls=1_000_000,
):
    """Mixed unary and streaming calls of random `pool` rows (a RowPool
    scored alone) from `clients` coroutines for `seconds` (at most
    `max_calls`); about cancel_fraction of them cancelled at a random moment
    in [0, 10 ms]. Every answer that arrives is checked against its rows'
    solo bits. Returns outcome counts (calls, unary_ok, unary_cancelled,
    stream_ok, stream_short, stream_cancelled, <kind>_<gRPC code>,
    rows_checked, rows_mismatched)."""
    counts = Counter()
    end = time.monotonic() + seconds
    channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
    stubs = [pb_grpc.LogProbServiceStub(c) for c in channels]

    def make_request(rng):
        rows = rng.sample(range(len(pool.targets)), rng.randint(1, 8))
        return rows, requests_module.logprob_request(
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
        while time.monotonic() < end and counts["calls"] < max_calls:
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
