"""Bits never depend on batching: rows scored alone equal the same rows sent
in other groupings by many concurrent callers (unary and streaming)."""

import concurrent.futures
import random

import detlogp

POOL_ROWS = 48
CALLERS = 16
CALLS_PER_CALLER = 12


def test_bits_equal_solo_under_concurrent_mixed_batching(server, model):
    hidden, targets = model.random_rows(POOL_ROWS, seed=31)
    with detlogp.Client(server.target, timeout=30.0) as client:
        solo = [
            client.logprobs(hidden[i : i + 1], targets[i : i + 1], return_lse=True)
            for i in range(POOL_ROWS)
        ]
        key = solo[0].determinism_key
        solo_bits = [(s.logprobs.tobytes(), s.lse.tobytes()) for s in solo]

        def caller(seed):
            rng = random.Random(seed)
            checked = mismatched = 0
            requests = []
            for _ in range(CALLS_PER_CALLER):
                rows = rng.sample(range(POOL_ROWS), rng.randint(1, 8))
                requests.append(rows)
            if seed % 2:
                answers = [
                    client.logprobs(hidden[rows], targets[rows], return_lse=True)
                    for rows in requests
                ]
            else:
                answers = list(
                    client.stream(
                        [
                            dict(hidden=hidden[rows], targets=targets[rows], return_lse=True)
                            for rows in requests
                        ]
                    )
                )
            for rows, answer in zip(requests, answers):
                assert answer.determinism_key == key
                for j, row in enumerate(rows):
                    checked += 1
                    got = (answer.logprobs[j : j + 1].tobytes(), answer.lse[j : j + 1].tobytes())
                    mismatched += got != solo_bits[row]
            return checked, mismatched

        with concurrent.futures.ThreadPoolExecutor(CALLERS) as pool:
            outcomes = list(pool.map(caller, range(CALLERS)))
    checked = sum(c for c, _ in outcomes)
    mismatched = sum(m for _, m in outcomes)
    print(
        f"{CALLERS} callers x {CALLS_PER_CALLER} calls (half streaming): "
        f"{checked} rows checked against solo bits, {mismatched} differ"
    )
    assert mismatched == 0 and checked > 0


def test_same_rows_in_one_big_request_equal_solo(client, model):
    hidden, targets = model.random_rows(32, seed=32)
    whole = client.logprobs(hidden, targets, return_lse=True)
    for i in (0, 7, 31):
        alone = client.logprobs(hidden[i : i + 1], targets[i : i + 1], return_lse=True)
        assert alone.logprobs.tobytes() == whole.logprobs[i : i + 1].tobytes()
        assert alone.lse.tobytes() == whole.lse[i : i + 1].tobytes()
