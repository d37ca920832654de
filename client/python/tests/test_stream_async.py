"""The streaming helper (in order, ids echoed) and the asyncio client."""

import asyncio

import detlogp
import numpy as np
import pytest
from detlogp.aio import AsyncClient
from detlogp.testing import free_port


def test_stream_answers_in_order_with_ids(client, model):
    items = []
    for i in range(20):
        hidden, targets = model.random_rows(1 + i % 4, seed=100 + i)
        items.append((hidden, targets))
    answers = list(client.stream(items))
    assert [a.request_id for a in answers] == [str(i) for i in range(20)]
    for (hidden, targets), answer in zip(items, answers):
        unary = client.logprobs(hidden, targets)
        assert unary.logprobs.tobytes() == answer.logprobs.tobytes()


def test_stream_of_nothing_is_empty(client):
    assert list(client.stream([])) == []


def test_async_client_matches_sync_bits_and_runs_concurrently(server, client, model):
    hidden, targets = model.random_rows(6, seed=41)
    want = client.logprobs(hidden, targets, return_lse=True)

    async def main():
        async with AsyncClient(server.target, timeout=20.0) as aclient:
            info = await aclient.info()
            assert info.hidden_size == model.hidden
            assert await aclient.health() == "SERVING"
            results = await asyncio.gather(
                *[aclient.logprobs(hidden, targets, return_lse=True) for _ in range(50)]
            )
            streamed = [r async for r in aclient.stream([(hidden, targets)] * 5)]

            async def gen():
                for _ in range(3):
                    yield (hidden, targets)

            streamed_async = [r async for r in aclient.stream(gen())]
            with pytest.raises(detlogp.InvalidArgument) as error:
                await aclient.logprobs(hidden, np.full(6, model.vocab))
            assert error.value.field == "target_ids[0]"
            return results + streamed + streamed_async

    results = asyncio.run(main())
    assert len(results) == 58
    assert all(r.logprobs.tobytes() == want.logprobs.tobytes() for r in results)
    assert all(r.lse is None or r.lse.tobytes() == want.lse.tobytes() for r in results)


def test_async_retries_and_deadlines(model):
    async def main():
        policy = detlogp.RetryPolicy(max_attempts=4, initial_backoff_s=0.01)
        async with AsyncClient(f"127.0.0.1:{free_port()}", retry=policy, timeout=5.0) as aclient:
            with pytest.raises(detlogp.Unavailable):
                await aclient.logprobs(*model.random_rows(1, seed=42))
            return aclient.attempts, aclient.retries

    attempts, retries = asyncio.run(main())
    assert (attempts, retries) == (4, 3)


def test_health_reports_serving(client):
    assert client.health() == "SERVING"


def test_async_stream_reports_the_servers_status_for_an_invalid_item(server, model):
    """The server ends the stream at the invalid item while the client is
    still writing the items behind it; the error must name the field, not be
    grpcio's INTERNAL for the write that lost that race."""
    hidden, targets = model.random_rows(4, seed=61)
    beyond_vocabulary = np.full(4, model.vocab)
    items = [(hidden, targets)] * 3 + [(hidden, beyond_vocabulary)] + [(hidden, targets)] * 200

    async def main():
        errors = []
        async with AsyncClient(server.target, timeout=20.0) as aclient:
            for _ in range(20):
                answered = 0
                with pytest.raises(detlogp.DetlogpError) as error:
                    async for _ in aclient.stream(items):
                        answered += 1
                errors.append((type(error.value), error.value.field, answered))
        return errors

    assert asyncio.run(main()) == [(detlogp.InvalidArgument, "target_ids[0]", 3)] * 20
