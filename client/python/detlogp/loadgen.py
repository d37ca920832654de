"""An asyncio load generator that checks every answer's bits.

A pool of rows is scored alone first (the "solo" bits). Then `clients`
concurrent callers, each on its own channel, send unary and streaming calls
made of random pool rows, for a bounded time and count, either as fast as
they can (closed loop, optional think time) or at a fixed total request rate
(open loop). Every answer is checked: exactly one per request, ids echoed in
order, every row's bits equal to its solo bits, the determinism key equal.

    pool = RowPool.random(client_info, rows=64, seed=0)
    pool.score_solo(target)
    report = asyncio.run(run_load(LoadConfig(targets=[target]), pool))
    print(report.table()); json.dumps(report.summary())
"""
import asyncio
import dataclasses
import random
import time
from collections import Counter
from typing import List, Optional

import numpy as np

from detlogp.aio import AsyncClient
from detlogp.client import Client
from detlogp.errors import DetlogpError
from detlogp.retry import NO_RETRY


@dataclasses.dataclass
class RowPool:
    """Rows to draw requests from, with each row's solo answer bits."""

    hidden: np.ndarray
    targets: np.ndarray
    solo_logp: Optional[np.ndarray] = None  # float32 per row
    solo_lse: Optional[np.ndarray] = None
    key: str = ""

    @classmethod
    def random(cls, hidden_size, vocab_size, rows=64, seed=0):
        rng = np.random.default_rng(seed)
        return cls(rng.standard_normal((rows, hidden_size)).astype(np.float32),
                   rng.integers(0, vocab_size, size=rows))

    def score_solo(self, target, timeout=60.0):
        """Scores every row alone (N=1), sequentially, on one target."""
        logp, lse = [], []
        with Client(target, timeout=timeout) as client:
            for i in range(len(self.targets)):
                r = client.logprobs(self.hidden[i:i + 1], self.targets[i:i + 1],
                                    return_lse=True)
                logp.append(r.logprobs[0])
                lse.append(r.lse[0])
                self.key = r.determinism_key
        self.solo_logp = np.array(logp, np.float32)
        self.solo_lse = np.array(lse, np.float32)


@dataclasses.dataclass
class LoadConfig:
    targets: List[str]
    clients: int = 200             # concurrent callers, one channel each
    duration_s: float = 60.0       # stop issuing after this long
    max_requests: int = 1_000_000  # and after this many requests
    rate: Optional[float] = None   # calls started/s in all (open loop; a stream is one call); None: closed loop
    stream_fraction: float = 0.5   # share of calls that are streams
    stream_requests: tuple = (1, 5)  # requests per stream, inclusive
    rows: tuple = (1, 8)           # rows per request, inclusive
    think_s: tuple = (0.0, 0.0)    # closed loop: pause between calls
    timeout_s: float = 30.0        # per call
    channels: Optional[int] = None  # shared channels; None: one per client
    seed: int = 0


@dataclasses.dataclass
class LoadReport:
    requests_sent: int = 0
    answers: int = 0
    rows_answered: int = 0
    rows_checked: int = 0
    rows_mismatched: int = 0
    key_mismatches: int = 0
    lost: int = 0          # sent, never answered, no error either
    duplicated: int = 0    # answered more than once
    out_of_order: int = 0  # stream answers whose id was not the next one
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
            "requests_sent": self.requests_sent, "answers": self.answers,
            "unary_calls": self.unary_calls, "stream_calls": self.stream_calls,
            "requests_per_s": round(self.answers / wall, 1),
            "rows_per_s": round(self.rows_answered / wall, 1),
            "latency_ms": {"p50": pct(50), "p90": pct(90), "p99": pct(99),
                           "max": round(float(lat.max()), 3)},
            "rows_checked": self.rows_checked, "rows_mismatched": self.rows_mismatched,
            "key_mismatches": self.key_mismatches, "lost": self.lost,
            "duplicated": self.duplicated, "out_of_order": self.out_of_order,
            "errors": dict(self.errors),
        }

    def table(self):
        s = self.summary()
        lat = s["latency_ms"]
        return "\n".join([
            f"{'requests/s':>12} {'rows/s':>10} {'p50 ms':>8} {'p90 ms':>8} "
            f"{'p99 ms':>8} {'max ms':>8}",
            f"{s['requests_per_s']:>12} {s['rows_per_s']:>10} {lat['p50']:>8} "
            f"{lat['p90']:>8} {lat['p99']:>8} {lat['max']:>8}",
            f"answers {s['answers']}/{s['requests_sent']} sent "
            f"({s['unary_calls']} unary calls, {s['stream_calls']} streams), "
            f"rows checked {s['rows_checked']}, mismatched {s['rows_mismatched']}, "
            f"lost {s['lost']}, duplicated {s['duplicated']}, errors {s['errors']}",
        ])


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
        rows = self.rng.sample(range(len(self.pool.targets)),
                               self.rng.randint(*self.config.rows))
        request_id = f"c{self.index}-{self.seq}"
        self.seq += 1
        self.report.requests_sent += 1
        return request_id, rows

    def _check(self, request_id, rows, answer, sent_at, answered):
        report = self.report
        report.latencies_s.append(time.monotonic() - sent_at)
        if answered.get(request_id):
            report.duplicated += 1
        answered[request_id] = answered.get(request_id, 0) + 1
        report.answers += 1
        report.rows_answered += len(rows)
        if answer.determinism_key != self.pool.key:
            report.key_mismatches += 1
        got_logp = answer.logprobs.view(np.uint32)
        got_lse = answer.lse.view(np.uint32) if answer.lse is not None else None
        want_logp = self.pool.solo_logp[rows].view(np.uint32)
        want_lse = self.pool.solo_lse[rows].view(np.uint32)
        report.rows_checked += len(rows)
        if got_lse is None or len(got_logp) != len(rows) or len(got_lse) != len(rows):
            report.rows_mismatched += len(rows)
        else:
            report.rows_mismatched += int(np.sum((got_logp != want_logp) |
                                                 (got_lse != want_lse)))

    async def unary(self):
        request_id, rows = self._new_request()
        self.report.unary_calls += 1
        sent_at = time.monotonic()
        answered = {}
        try:
            answer = await self.client.logprobs(
                self.pool.hidden[rows], self.pool.targets[rows], return_lse=True,
                request_id=request_id, timeout=self.config.timeout_s)
        except DetlogpError as error:
            self.report.errors[error.code.name if error.code else "CLIENT"] += 1
            return
        if answer.request_id != request_id:
            self.report.out_of_order += 1
        self._check(request_id, rows, answer, sent_at, answered)

    async def stream(self):
        count = self.rng.randint(*self.config.stream_requests)
        count = max(1, min(count, self.budget.take(count - 1) + 1))
        self.report.stream_calls += 1
        sent = []  # (request_id, rows, sent_at) in order
        answered = {}

        def items():
            for _ in range(count):
                request_id, rows = self._new_request()
                sent.append((request_id, rows, time.monotonic()))
                yield dict(hidden=self.pool.hidden[rows],
                           targets=self.pool.targets[rows], return_lse=True,
                           request_id=request_id)

        got = 0
        try:
            async for answer in self.client.stream(items(), timeout=self.config.timeout_s):
                if got >= len(sent) or answer.request_id != sent[got][0]:
                    self.report.out_of_order += 1
                    match = [s for s in sent if s[0] == answer.request_id]
                    if not match:
                        continue
                    request_id, rows, sent_at = match[0]
                else:
                    request_id, rows, sent_at = sent[got]
                self._check(request_id, rows, answer, sent_at, answered)
                got += 1
        except DetlogpError as error:
            self.report.errors[error.code.name if error.code else "CLIENT"] += 1
            return
        self.report.lost += sum(1 for s in sent if s[0] not in answered)


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
    report = LoadReport()
    n_channels = config.channels or config.clients
    clients = [AsyncClient(config.targets, timeout=config.timeout_s, retry=NO_RETRY)
               for _ in range(n_channels)]
    began = time.monotonic()
    budget = _Budget(config.max_requests, began + config.duration_s)
    callers = [_Caller(i, clients[i % n_channels], pool, config, report, budget)
               for i in range(config.clients)]

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
                _, in_flight = await asyncio.wait(in_flight,
                                                  return_when=asyncio.FIRST_COMPLETED)
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
