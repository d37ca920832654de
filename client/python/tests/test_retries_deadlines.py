"""Retries with backoff on UNAVAILABLE and queue-full RESOURCE_EXHAUSTED,
round-robin over several targets, and deadlines."""

import concurrent.futures
import threading
import time

import detlogp
import pytest
from detlogp.testing import LocalServer, TestModel, free_port

FAST_RETRY = detlogp.RetryPolicy(max_attempts=30, initial_backoff_s=0.02, max_backoff_s=0.3)


def test_unavailable_is_retried_until_the_server_comes_up(server_binary, model):
    port = free_port()
    server = LocalServer(server_binary, model.flags)
    starter = threading.Timer(0.7, lambda: server.start(port=port))
    starter.start()
    try:
        with detlogp.Client(f"127.0.0.1:{port}", timeout=30.0, retry=FAST_RETRY) as client:
            hidden, targets = model.random_rows(2, seed=11)
            began = time.monotonic()
            result = client.logprobs(hidden, targets)
            print(
                f"answered after {time.monotonic() - began:.2f}s, "
                f"{client.retries} retries on UNAVAILABLE"
            )
            assert client.retries >= 1
            assert result.logprobs.shape == (2,)
    finally:
        starter.join()
        server.__exit__(None, None, None)


def test_unavailable_without_retries_raises_unavailable(model):
    with detlogp.Client(f"127.0.0.1:{free_port()}", timeout=5.0, retry=detlogp.NO_RETRY) as client:
        with pytest.raises(detlogp.Unavailable):
            client.logprobs(*model.random_rows(1, seed=12))
        assert client.attempts == 1


@pytest.fixture(scope="module")
def tiny_queue_server(server_binary, model):
    """Queue bound 8 rows; a lone 5-row request waits 150 ms for company, so a
    second 5-row request arriving meanwhile finds the queue full."""
    with LocalServer(
        server_binary,
        model.flags + ["--max_queue_rows=8", "--max_batch_rows=8", "--max_queue_delay_us=150000"],
    ) as server:
        yield server


def _burst(target, model, retry, calls=6):
    hidden, targets = model.random_rows(5, seed=13)
    with detlogp.Client(target, timeout=30.0, retry=retry) as client:

        def one(_):
            try:
                return client.logprobs(hidden, targets)
            except detlogp.DetlogpError as error:
                return error

        with concurrent.futures.ThreadPoolExecutor(calls) as pool:
            return list(pool.map(one, range(calls))), client.retries


def test_queue_full_raises_overloaded_without_retries(tiny_queue_server, model):
    outcomes, _ = _burst(tiny_queue_server.target, model, detlogp.NO_RETRY)
    overloaded = [o for o in outcomes if isinstance(o, detlogp.Overloaded)]
    answered = [o for o in outcomes if isinstance(o, detlogp.LogProbResult)]
    print(
        f"6 concurrent 5-row calls, queue bound 8: {len(answered)} answered, "
        f"{len(overloaded)} RESOURCE_EXHAUSTED ({overloaded[0].details if overloaded else ''})"
    )
    assert overloaded and all(o.queue_full for o in overloaded)
    assert len(answered) + len(overloaded) == 6


def test_queue_full_is_retried_until_answered(tiny_queue_server, model):
    outcomes, retries = _burst(tiny_queue_server.target, model, FAST_RETRY)
    print(
        f"6 concurrent calls with retries: {retries} retries, "
        f"{sum(isinstance(o, detlogp.LogProbResult) for o in outcomes)} answered"
    )
    assert all(isinstance(o, detlogp.LogProbResult) for o in outcomes), outcomes
    assert len({o.logprobs.tobytes() for o in outcomes}) == 1
    assert retries >= 1


def test_round_robin_alternates_between_targets(server_binary, tmp_path):
    model_a = TestModel(tmp_path, seed=21)
    model_b = TestModel(tmp_path, seed=22)
    with (
        LocalServer(server_binary, model_a.flags) as a,
        LocalServer(server_binary, model_b.flags) as b,
    ):
        with detlogp.Client([a.target, b.target]) as client:
            keys = [client.info().determinism_key for _ in range(6)]
        assert keys[0] != keys[1]
        assert keys == [keys[0], keys[1]] * 3
        print(f"round-robin keys: {keys}")


def test_round_robin_skips_a_dead_target_by_retrying(server, model):
    dead = f"127.0.0.1:{free_port()}"
    with detlogp.Client([dead, server.target], retry=FAST_RETRY, timeout=20) as client:
        hidden, targets = model.random_rows(2, seed=23)
        results = [client.logprobs(hidden, targets) for _ in range(6)]
        print(f"6 calls over [dead, live]: {client.retries} retries, all answered")
        assert len({r.logprobs.tobytes() for r in results}) == 1
        assert client.retries >= 1


@pytest.fixture(scope="module")
def slow_batch_server(server_binary, model):
    """A lone row waits 400 ms in the queue for company."""
    with LocalServer(server_binary, model.flags + ["--max_queue_delay_us=400000"]) as server:
        yield server


def test_deadline_shorter_than_the_queue_wait_raises_deadline_exceeded(slow_batch_server, model):
    with detlogp.Client(slow_batch_server.target, retry=FAST_RETRY) as client:
        began = time.monotonic()
        with pytest.raises(detlogp.DeadlineExceeded):
            client.logprobs(*model.random_rows(1, seed=24), timeout=0.05)
        elapsed = time.monotonic() - began
        print(f"timeout=0.05s raised DeadlineExceeded after {elapsed:.3f}s")
        assert elapsed < 0.35
        assert client.retries == 0  # DEADLINE_EXCEEDED is never retried


def test_default_timeout_applies_and_longer_deadline_is_answered(slow_batch_server, model):
    with detlogp.Client(slow_batch_server.target, timeout=0.05) as client:
        with pytest.raises(detlogp.DeadlineExceeded):
            client.logprobs(*model.random_rows(1, seed=25))
        assert client.logprobs(*model.random_rows(1, seed=25), timeout=5.0).logprobs.shape == (1,)
