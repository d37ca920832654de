"""A fleet's burst: many worker processes, each with its own detlogp.Client,
score large batches at the same moment against one server with its default
queue bound. Every call is answered (refused requests are sent again after
the server's retry delay, never failed), and every row's bits equal those it
gets in a small call alone.

DETLOGP_FLEET_SCALE (default 1) scales the rows of every scenario down for a
quick local run (e.g. 0.25)."""

import multiprocessing
import os
import time

import detlogp
import numpy as np
import pytest
from detlogp.testing import LocalServer, TestModel, rollout_worker, seeded_rows

HIDDEN, VOCAB = 128, 256
SCALE = float(os.environ.get("DETLOGP_FLEET_SCALE", "1"))
SMALL_CALL_ROWS = 1024


def _rows(seed, n):
    return seeded_rows(seed, n, HIDDEN, VOCAB)


@pytest.fixture(scope="module")
def fleet_server(server_binary, tmp_path_factory):
    model = TestModel(
        tmp_path_factory.mktemp("fleet-model"),
        hidden=HIDDEN,
        vocab=VOCAB,
        padded_vocab=VOCAB,
        seed=11,
    )
    # The server's own queue bound: 1 s of work at its drain rate.
    with LocalServer(server_binary, ["--device=cpu", *model.flags]) as server:
        yield server


def _alone(target, seed, rows):
    """The same rows scored in small calls, one at a time."""
    hidden, targets = _rows(seed, rows)
    pieces = []
    with detlogp.Client(target, timeout=600) as client:
        for begin in range(0, rows, SMALL_CALL_ROWS):
            end = min(begin + SMALL_CALL_ROWS, rows)
            pieces.append(client.logprobs(hidden[begin:end], targets[begin:end]).logprobs)
    return np.concatenate(pieces).tobytes()


@pytest.mark.parametrize("workers,rows", [(8, 32768), (32, 8192)])
def test_burst_of_workers_is_answered_whole_with_equal_bits(fleet_server, report, workers, rows):
    rows = max(int(rows * SCALE), 1)
    rounds = 3
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    start = context.Event()
    processes = [
        context.Process(
            target=rollout_worker,
            args=(fleet_server.target, seed, rows, HIDDEN, VOCAB, rounds, start, answers),
        )
        for seed in range(workers)
    ]
    for process in processes:
        process.start()
    time.sleep(2.0)  # every worker connected and its rows made
    began = time.monotonic()
    start.set()
    got = [answers.get(timeout=300) for _ in range(workers * rounds)]
    elapsed = time.monotonic() - began
    for process in processes:
        process.join(timeout=60)
    failed = [(seed, r, error) for seed, r, _, error in got if error is not None]
    report(
        f"{workers} workers x {rows} rows x {rounds} rounds: "
        f"{len(got) - len(failed)} answered, {len(failed)} failed, "
        f"{workers * rows * rounds / elapsed:,.0f} rows/s"
    )
    assert not failed, failed[:3]
    # Bits: every worker's first round against the same rows in small calls.
    for seed in range(workers):
        served = next(bits for s, r, bits, _ in got if s == seed and r == 0)
        assert served == _alone(fleet_server.target, seed * 100, rows), seed


def test_one_call_larger_than_the_queue_is_answered(fleet_server, report):
    rows = max(int(1_048_576 * SCALE), 1)
    hidden, targets = _rows(7, rows)
    began = time.monotonic()
    with detlogp.Client(fleet_server.target, timeout=900) as client:
        result = client.logprobs(hidden, targets)
    report(f"one call of {rows} rows: {rows / (time.monotonic() - began):,.0f} rows/s")
    assert result.logprobs.shape == (rows,)
    # A sample of small calls across the whole call: the same bits.
    with detlogp.Client(fleet_server.target, timeout=600) as client:
        for begin in range(0, rows, max(rows // 8, 1)):
            end = min(begin + SMALL_CALL_ROWS, rows)
            alone = client.logprobs(hidden[begin:end], targets[begin:end]).logprobs
            assert alone.tobytes() == result.logprobs[begin:end].tobytes(), begin
