"""Entropy and top-k log-probs per row: present only when asked
for, with the promised shapes and order; a row's bits never depend on what
it was batched with, on the k asked for (a smaller k is a prefix), on the
other outputs asked for, or on the client (sync, asyncio, streams); values
match a float64 reference; top_k above the server's maximum is refused
naming the field.

The first tests need no server (request building, answer checks)."""

import asyncio
import concurrent.futures
import random

import detlogp
import numpy as np
import pytest
from detlogp import requests, results
from detlogp._common import SentRequests
from detlogp.testing import LocalServer, TestModel
from detlogp.v1 import detlogp_pb2 as pb

# The server's default --max_top_k (the `server` fixture does not set it).
MAX_TOP_K = 20
# Accuracy against float64 on the same bf16 inputs (the extras' targets).
ENTROPY_ATOL = 2e-3
TOP_LOGPROB_ATOL = 1e-3
RANK_GAP = 1e-4


def bits(array):
    return None if array is None else np.ascontiguousarray(array).tobytes()


def row_bits(result, i):
    """(logprob, entropy, top_ids, top_logprobs) bits of row i; None for
    what the result does not hold."""
    return (
        bits(result.logprobs[i : i + 1]),
        None if result.entropy is None else bits(result.entropy[i : i + 1]),
        None if result.top_ids is None else bits(result.top_ids[i]),
        None if result.top_logprobs is None else bits(result.top_logprobs[i]),
    )


# ---------------------------------------------------------------- no server
def test_request_carries_entropy_and_top_k():
    hidden = np.zeros((2, 4), np.float32)
    request = requests.logprob_request(hidden, [1, 2], return_entropy=True, top_k=5)
    assert request.return_entropy and request.top_k == 5
    plain = requests.logprob_request(hidden, [1, 2])
    assert not plain.return_entropy and plain.top_k == 0
    assert requests.logprob_request(hidden, [1, 2], top_k=np.int64(3)).top_k == 3
    assert requests.logprob_request(hidden, [1, 2], top_k=None).top_k == 0


def test_negative_or_fractional_top_k_is_refused_before_sending():
    hidden = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="top_k"):
        requests.logprob_request(hidden, [1], top_k=-1)
    with pytest.raises(TypeError, match="top_k"):
        requests.logprob_request(hidden, [1], top_k=2.5)
    with detlogp.Client("127.0.0.1:1") as client:  # nothing is sent
        with pytest.raises(ValueError, match="top_k"):
            client.logprobs(hidden, [1], top_k=-3)
        assert client.attempts == 0


def test_negative_top_k_is_refused_by_the_asyncio_client():
    async def run():
        async with detlogp.aio.AsyncClient("127.0.0.1:1") as client:
            with pytest.raises(ValueError, match="top_k"):
                await client.logprobs(np.zeros((1, 4), np.float32), [1], top_k=-1)

    asyncio.run(run())


def _answer(request):
    rows, k = len(request.target_ids), request.top_k
    return pb.LogProbResponse(
        logprobs=[-1.0] * rows,
        lse=[2.0] * rows if request.return_lse else [],
        entropy=[0.5 + r for r in range(rows)] if request.return_entropy else [],
        top_ids=[100 * r + j for r in range(rows) for j in range(k)],
        top_logprobs=[-0.25 * (j + 1) for r in range(rows) for j in range(k)],
    )


def test_result_shapes_and_dtypes_follow_the_request():
    hidden = np.zeros((3, 4), np.float32)
    for entropy, k in [(False, 0), (True, 0), (False, 4), (True, 4)]:
        request = requests.logprob_request(hidden, [1, 2, 3], return_entropy=entropy, top_k=k)
        result = results.logprob_result(_answer(request), request)
        assert (result.entropy is not None) == entropy
        assert (result.top_ids is not None) == (k > 0)
        assert (result.top_logprobs is not None) == (k > 0)
        if entropy:
            assert result.entropy.dtype == np.float32 and result.entropy.shape == (3,)
        if k:
            assert result.top_ids.dtype == np.int64 and result.top_ids.shape == (3, k)
            assert result.top_logprobs.dtype == np.float32
            assert result.top_logprobs.shape == (3, k)
            assert result.top_ids[2, 1] == 201
    empty = requests.logprob_request(np.zeros((0, 4), np.float32), [], return_entropy=True, top_k=3)
    result = results.logprob_result(_answer(empty), empty)
    assert result.entropy.shape == (0,) and result.top_ids.shape == (0, 3)


@pytest.mark.parametrize(
    "field,damage",
    [
        ("logprobs", lambda r: r.logprobs.pop()),
        ("entropy", lambda r: r.entropy.pop()),
        ("entropy", lambda r: r.ClearField("entropy")),
        ("top_ids", lambda r: r.top_ids.append(7)),
        ("top_ids", lambda r: r.ClearField("top_ids")),
        ("top_logprobs", lambda r: r.top_logprobs.pop()),
        ("lse", lambda r: r.lse.append(1.0)),
    ],
)
def test_a_malformed_answer_is_data_loss_naming_the_field(field, damage):
    request = requests.logprob_request(
        np.zeros((3, 4), np.float32), [1, 2, 3], return_entropy=True, top_k=2
    )
    response = _answer(request)
    damage(response)
    with pytest.raises(detlogp.DataLoss) as info:
        results.logprob_result(response, request)
    assert info.value.field == field, info.value.details


def test_extras_not_asked_for_are_data_loss():
    request = requests.logprob_request(np.zeros((2, 4), np.float32), [1, 2])
    response = _answer(request)
    response.entropy.extend([1.0, 1.0])
    with pytest.raises(detlogp.DataLoss) as info:
        results.logprob_result(response, request)
    assert info.value.field == "entropy"


def test_sent_requests_pair_answers_in_order():
    sent = SentRequests()
    a, b = pb.LogProbRequest(request_id="a"), pb.LogProbRequest(request_id="b")
    sent.add(a)
    sent.add(b)
    assert sent.answered() is a and sent.answered() is b
    with pytest.raises(detlogp.DataLoss):
        sent.answered()


# ---------------------------------------------------------------- server
def test_fields_present_only_when_asked(client, model):
    hidden, targets = model.random_rows(5, seed=101)
    for entropy, k in [(False, 0), (True, 0), (False, 3), (True, 3)]:
        r = client.logprobs(hidden, targets, return_entropy=entropy, top_k=k)
        assert r.logprobs.shape == (5,) and r.lse is None
        if entropy:
            assert r.entropy.dtype == np.float32 and r.entropy.shape == (5,)
        else:
            assert r.entropy is None
        if k:
            assert r.top_ids.dtype == np.int64 and r.top_ids.shape == (5, k)
            assert r.top_logprobs.dtype == np.float32 and r.top_logprobs.shape == (5, k)
        else:
            assert r.top_ids is None and r.top_logprobs is None
    raw = client.compute(requests.logprob_request(hidden, targets))
    assert len(raw.entropy) == len(raw.top_ids) == len(raw.top_logprobs) == 0


def test_top_k_rows_descend_with_ties_to_the_lower_id(client, model):
    hidden, targets = model.random_rows(16, seed=102)
    r = client.logprobs(hidden, targets, return_lse=True, return_entropy=True, top_k=MAX_TOP_K)
    ids, values = r.top_ids, r.top_logprobs
    assert np.all((ids >= 0) & (ids < model.vocab))  # padding rows never chosen
    for i in range(len(targets)):
        assert len(set(ids[i].tolist())) == MAX_TOP_K
        assert np.all(np.diff(values[i]) <= 0), values[i]
        tied = np.diff(values[i]) == 0
        assert np.all(np.diff(ids[i])[tied] > 0)
    assert np.all(values <= 0) and np.all(np.isfinite(values))
    # The target's own log-prob, where it is among the top: the same value.
    for i, target in enumerate(targets):
        where = np.flatnonzero(ids[i] == target)
        if where.size:
            assert abs(values[i, where[0]] - r.logprobs[i]) <= 1e-5
        else:
            assert r.logprobs[i] <= values[i, -1] + 1e-5
    # 0 <= H <= log V, and the top-1 log-prob is at least -H.
    assert np.all(r.entropy >= 0) and np.all(r.entropy <= np.log(model.vocab) + 1e-4)
    assert np.all(values[:, 0] >= -r.entropy - 1e-5)


def test_smaller_k_is_a_prefix_and_other_outputs_keep_their_bits(client, model):
    hidden, targets = model.random_rows(12, seed=103)
    plain = client.logprobs(hidden, targets, return_lse=True)
    full = client.logprobs(hidden, targets, return_entropy=True, top_k=MAX_TOP_K)
    for k in (1, 2, 5, 13, MAX_TOP_K):
        for entropy in (False, True):
            r = client.logprobs(hidden, targets, return_lse=True, return_entropy=entropy, top_k=k)
            assert bits(r.top_ids) == bits(full.top_ids[:, :k]), k
            assert bits(r.top_logprobs) == bits(full.top_logprobs[:, :k]), k
            # log p(target), lse and entropy never depend on what else is asked.
            assert bits(r.logprobs) == bits(plain.logprobs)
            assert bits(r.lse) == bits(plain.lse)
            if entropy:
                assert bits(r.entropy) == bits(full.entropy)
    only_entropy = client.logprobs(hidden, targets, return_entropy=True)
    assert bits(only_entropy.entropy) == bits(full.entropy)
    assert bits(only_entropy.logprobs) == bits(plain.logprobs)


def test_rows_match_float64_reference(client, model):
    hidden, targets = model.random_rows(24, seed=104)
    for temperature in (1.0, 0.7, 2.0):
        r = client.logprobs(
            hidden, targets, temperature=temperature, return_entropy=True, top_k=MAX_TOP_K
        )
        want_h, want_ids, want_lp = model.reference_entropy_top_k(
            hidden, MAX_TOP_K + 1, temperature
        )
        err = np.abs(r.entropy - want_h)
        print(
            f"T={temperature}: entropy max |err| {err.max():.2e}, "
            f"top-k max |err| {np.abs(r.top_logprobs - want_lp[:, :-1]).max():.2e}"
        )
        assert err.max() <= ENTROPY_ATOL
        assert np.abs(r.top_logprobs - want_lp[:, :-1]).max() <= TOP_LOGPROB_ATOL
        _check_ranking(r.top_ids, want_ids, want_lp)


def _check_ranking(got_ids, want_ids, want_lp):
    """got_ids[:, j] == want_ids[:, j] wherever the float64 value at j is more
    than RANK_GAP from its neighbours (want_* hold one column more than
    got_ids, for the gap after the last)."""
    k = got_ids.shape[1]
    gaps = -np.diff(want_lp, axis=1)  # [N, k]: value j minus value j+1
    before = np.concatenate([np.full((len(gaps), 1), np.inf), gaps[:, :-1]], axis=1)
    separated = (before > RANK_GAP) & (gaps > RANK_GAP)
    checked = int(separated.sum())
    assert checked > 0.5 * separated.size
    mismatch = separated & (got_ids != want_ids[:, :k])
    assert not mismatch.any(), np.argwhere(mismatch)


def test_peaked_row_and_padding_that_would_win(client, model):
    # h along one real token's weight: that token dominates (entropy ~ 0,
    # top-1 log-prob ~ 0); along a padding row's weight: the padding row
    # would win if it were scored, and must never appear.
    from detlogp import tensors

    weight = tensors.bf16_bits_to_float32(model.weight_bits)
    real, padding = 17, model.padded_vocab - 3
    hidden = np.stack([weight[real] * 8.0, weight[padding] * 8.0]).astype(np.float32)
    r = client.logprobs(hidden, [real, 0], return_entropy=True, top_k=MAX_TOP_K)
    want_h, want_ids, want_lp = model.reference_entropy_top_k(hidden, MAX_TOP_K + 1)
    assert r.top_ids[0, 0] == real
    assert np.all(r.top_ids < model.vocab)
    assert np.abs(r.entropy - want_h).max() <= ENTROPY_ATOL
    assert np.abs(r.top_logprobs - want_lp[:, :-1]).max() <= TOP_LOGPROB_ATOL
    _check_ranking(r.top_ids, want_ids, want_lp)


@pytest.fixture(scope="module")
def flat_server(server_binary, tmp_path_factory):
    """A model without bias: a zero hidden row makes every logit equal."""
    flat = TestModel(tmp_path_factory.mktemp("flat"), with_bias=False, seed=11)
    with LocalServer(server_binary, flat.flags + ["--cpu_threads=1"]) as srv:
        yield srv, flat


def test_flat_row_entropy_is_log_v_and_top_k_the_lowest_ids(flat_server):
    srv, flat = flat_server
    with detlogp.Client(srv.target, timeout=20.0) as client:
        r = client.logprobs(
            np.zeros((2, flat.hidden), np.float32), [0, 5], return_entropy=True, top_k=MAX_TOP_K
        )
    assert np.abs(r.entropy - np.log(flat.vocab)).max() <= ENTROPY_ATOL
    assert np.array_equal(r.top_ids, np.tile(np.arange(MAX_TOP_K), (2, 1)))
    assert np.abs(r.top_logprobs + np.log(flat.vocab)).max() <= TOP_LOGPROB_ATOL


def test_top_k_above_the_maximum_is_invalid_argument(client, model):
    hidden, targets = model.random_rows(2, seed=105)
    assert client.logprobs(hidden, targets, top_k=MAX_TOP_K).top_ids.shape == (2, MAX_TOP_K)
    for k in (MAX_TOP_K + 1, model.vocab + 1, 2**40):
        attempts = client.attempts
        with pytest.raises(detlogp.InvalidArgument) as info:
            client.logprobs(hidden, targets, top_k=k)
        print(f"top_k={k}: {info.value.details}")
        assert info.value.field == "top_k", info.value.details
        assert client.attempts - attempts == 1  # never retried
    # A negative top_k that bypasses the client's check: the server refuses it.
    raw = requests.logprob_request(hidden, targets)
    raw.top_k = -1
    with pytest.raises(detlogp.InvalidArgument) as info:
        client.compute(raw)
    assert info.value.field == "top_k", info.value.details


def test_a_negative_top_k_item_ends_a_stream_with_value_error(client, server, model):
    hidden, targets = model.random_rows(2, seed=107)
    items = [
        dict(hidden=hidden, targets=targets, top_k=3),
        dict(hidden=hidden, targets=targets, top_k=-1),
    ]
    got = []
    with pytest.raises(ValueError, match="top_k"):
        for answer in client.stream(items):
            got.append(answer)
    assert len(got) <= 1

    async def run():
        async with detlogp.aio.AsyncClient(server.target, timeout=20.0) as aclient:
            with pytest.raises(ValueError, match="top_k"):
                async for _ in aclient.stream(items):
                    pass

    asyncio.run(run())


# -------------------------------------------- bits across batch compositions
POOL_ROWS = 40
CALLERS = 8
CALLS_PER_CALLER = 10
# What a request asks for beyond log p(target): neither, entropy, top-k of
# several sizes, both.
MIXES = [(False, 0), (True, 0), (False, 1), (False, 7), (True, 4), (True, MAX_TOP_K)]


@pytest.fixture(scope="module")
def solo(server, model):
    """Every pool row scored alone with entropy and the largest top-k."""
    hidden, targets = model.random_rows(POOL_ROWS, seed=106)
    with detlogp.Client(server.target, timeout=30.0) as client:
        answers = [
            client.logprobs(
                hidden[i : i + 1], targets[i : i + 1], return_entropy=True, top_k=MAX_TOP_K
            )
            for i in range(POOL_ROWS)
        ]
    return hidden, targets, answers


def _mismatches(answer, rows, entropy, k, solo_answers):
    """Rows of `answer` whose bits differ from their solo bits (top-k: the
    solo list's prefix of length k)."""
    bad = 0
    for j, row in enumerate(rows):
        want = solo_answers[row]
        ok = bits(answer.logprobs[j : j + 1]) == bits(want.logprobs)
        if entropy:
            ok &= bits(answer.entropy[j : j + 1]) == bits(want.entropy)
        else:
            ok &= answer.entropy is None
        if k:
            ok &= bits(answer.top_ids[j]) == bits(want.top_ids[0, :k])
            ok &= bits(answer.top_logprobs[j]) == bits(want.top_logprobs[0, :k])
        else:
            ok &= answer.top_ids is None
        bad += not ok
    return bad


def test_bits_equal_solo_under_concurrent_mixed_requests(server, solo):
    hidden, targets, solo_answers = solo

    def caller(seed):
        rng = random.Random(seed)
        plan = [
            (rng.sample(range(POOL_ROWS), rng.randint(1, 8)), rng.choice(MIXES))
            for _ in range(CALLS_PER_CALLER)
        ]
        with detlogp.Client(server.target, timeout=30.0) as client:
            if seed % 2:
                answers = [
                    client.logprobs(hidden[rows], targets[rows], return_entropy=e, top_k=k)
                    for rows, (e, k) in plan
                ]
            else:
                answers = list(
                    client.stream(
                        [
                            dict(
                                hidden=hidden[rows],
                                targets=targets[rows],
                                return_entropy=e,
                                top_k=k,
                            )
                            for rows, (e, k) in plan
                        ]
                    )
                )
        checked = sum(len(rows) for rows, _ in plan)
        bad = sum(
            _mismatches(a, rows, e, k, solo_answers) for a, (rows, (e, k)) in zip(answers, plan)
        )
        return checked, bad

    with concurrent.futures.ThreadPoolExecutor(CALLERS) as pool:
        outcomes = list(pool.map(caller, range(CALLERS)))
    checked = sum(c for c, _ in outcomes)
    bad = sum(b for _, b in outcomes)
    print(
        f"{CALLERS} callers x {CALLS_PER_CALLER} mixed calls: {checked} rows "
        f"checked against solo bits, {bad} differ"
    )
    assert checked > 0 and bad == 0


def test_one_big_request_and_reversed_order_equal_solo(client, solo):
    hidden, targets, solo_answers = solo
    rows = list(range(POOL_ROWS))
    for order in (rows, rows[::-1], rows[1::3] + rows[::3]):
        for entropy, k in MIXES:
            answer = client.logprobs(hidden[order], targets[order], return_entropy=entropy, top_k=k)
            assert _mismatches(answer, order, entropy, k, solo_answers) == 0, (entropy, k)


def test_asyncio_client_and_streams_give_the_sync_bits(server, solo):
    hidden, targets, solo_answers = solo
    rng = random.Random(7)
    plan = [(rng.sample(range(POOL_ROWS), rng.randint(1, 6)), rng.choice(MIXES)) for _ in range(12)]

    async def run():
        async with detlogp.aio.AsyncClient(server.target, timeout=30.0) as client:
            unary = await asyncio.gather(
                *[
                    client.logprobs(hidden[rows], targets[rows], return_entropy=e, top_k=k)
                    for rows, (e, k) in plan
                ]
            )
            streamed = [
                a
                async for a in client.stream(
                    [
                        dict(hidden=hidden[rows], targets=targets[rows], return_entropy=e, top_k=k)
                        for rows, (e, k) in plan
                    ]
                )
            ]
        return unary, streamed

    unary, streamed = asyncio.run(run())
    assert len(unary) == len(streamed) == len(plan)
    for answers in (unary, streamed):
        for answer, (rows, (e, k)) in zip(answers, plan):
            assert _mismatches(answer, rows, e, k, solo_answers) == 0
    # Rows with the sync client in the same groupings: the same bits.
    with detlogp.Client(server.target, timeout=30.0) as client:
        for answer, (rows, (e, k)) in zip(unary, plan):
            again = client.logprobs(hidden[rows], targets[rows], return_entropy=e, top_k=k)
            assert [row_bits(again, j) for j in range(len(rows))] == [
                row_bits(answer, j) for j in range(len(rows))
            ]


# ---------------------------------------------------------------- load tool
def test_loadgen_row_check_catches_each_output():
    """The load generator's per-row check (no server): a row whose entropy,
    top-k id or top-k log-prob bits differ from its solo bits, or that holds
    an output not asked for, is a mismatch; a smaller k is checked as a
    prefix of the solo list."""
    from detlogp import loadgen

    rng = np.random.default_rng(0)
    pool = loadgen.RowPool(hidden=np.zeros((4, 2), np.float32), targets=np.arange(4))
    pool.solo_logp = -rng.random(4).astype(np.float32)
    pool.solo_lse = rng.random(4).astype(np.float32)
    pool.solo_entropy = rng.random(4).astype(np.float32)
    pool.solo_top_ids = np.argsort(rng.random((4, 6)), axis=1).astype(np.int64)
    pool.solo_top_logprobs = -np.sort(rng.random((4, 6)), axis=1).astype(np.float32)
    rows = [2, 0]

    def answer(k, entropy):
        return results.LogProbResult(
            logprobs=pool.solo_logp[rows].copy(),
            lse=pool.solo_lse[rows].copy(),
            determinism_key="",
            entropy=pool.solo_entropy[rows].copy() if entropy else None,
            top_ids=pool.solo_top_ids[rows, :k].copy() if k else None,
            top_logprobs=pool.solo_top_logprobs[rows, :k].copy() if k else None,
        )

    def mismatches(extras, result):
        report = loadgen.LoadReport()
        return loadgen._row_mismatches(pool, rows, extras, result, report).tolist(), report

    for extras in loadgen.extras_mix(6):
        good, report = mismatches(extras, answer(extras[1], extras[0]))
        assert good == [False, False], extras
        assert report.checked_by_output["logprob"] == 2
    bad = answer(3, True)
    bad.entropy[1] = np.nextafter(bad.entropy[1], np.float32(1))
    assert mismatches((True, 3), bad)[0] == [False, True]
    bad = answer(3, True)
    bad.top_ids[0, 2] += 1
    flagged, report = mismatches((True, 3), bad)
    assert flagged == [True, False] and report.mismatched_by_output["top_k"] == 1
    bad = answer(3, False)
    bad.top_logprobs[1, 0] = np.nextafter(bad.top_logprobs[1, 0], np.float32(0))
    assert mismatches((False, 3), bad)[0] == [False, True]
    assert mismatches((False, 0), answer(0, True))[0] == [True, True]  # not asked
    assert mismatches((False, 0), answer(2, False))[0] == [True, True]
    assert mismatches((True, 0), answer(0, False))[0] == [True, True]  # missing
    bad = answer(0, False)
    bad.logprobs[0] = np.nextafter(bad.logprobs[0], np.float32(0))
    assert mismatches((False, 0), bad)[0] == [True, False]


def test_loadgen_needs_solo_extras_for_a_mixed_config():
    from detlogp import loadgen

    pool = loadgen.RowPool(
        hidden=np.zeros((1, 2), np.float32),
        targets=np.arange(1),
        solo_logp=np.zeros(1, np.float32),
        solo_lse=np.zeros(1, np.float32),
    )
    config = loadgen.LoadConfig(targets=["127.0.0.1:1"], extras=loadgen.extras_mix(5))
    with pytest.raises(ValueError, match="entropy"):
        asyncio.run(loadgen.run_load(config, pool))
    pool.solo_entropy = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="top_k=5"):
        asyncio.run(loadgen.run_load(config, pool))


def test_loadgen_mixed_extras_keep_solo_bits(server, model):
    """A short mixed run through run_load against the CPU server."""
    from detlogp import loadgen

    pool = loadgen.RowPool.random(model.hidden, model.vocab, rows=32, seed=9)
    pool.score_solo(server.target, entropy=True, top_k=MAX_TOP_K)
    pool.score_solo(server.target, entropy=True, top_k=MAX_TOP_K)  # same bits again
    config = loadgen.LoadConfig(
        targets=[server.target],
        clients=8,
        duration_s=2.0,
        max_requests=400,
        rows=(1, 6),
        timeout_s=30.0,
        seed=3,
        extras=loadgen.extras_mix(MAX_TOP_K),
    )
    report = asyncio.run(loadgen.run_load(config, pool))
    s = report.summary()
    print(report.table())
    assert report.answers == report.requests_sent > 0 and not report.errors
    assert report.rows_mismatched == 0 and report.key_mismatches == 0
    assert report.lost == report.duplicated == report.out_of_order == 0
    assert s["rows_checked_by_output"]["entropy"] > 0
    assert s["rows_checked_by_output"]["top_k"] > 0
    assert len(s["requests_by_extras"]) > 4


def test_console_score_prints_entropy_and_top_k(server, capsys):
    import json

    from detlogp import cli

    assert cli.main(
        ["--target", server.target, "--json", "score", "--rows", "3", "--entropy", "--top-k", "4"]
    ) in (0, None)
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 3
    for row in rows:
        assert row["entropy"] > 0 and len(row["top_ids"]) == 4
        assert row["top_logprobs"] == sorted(row["top_logprobs"], reverse=True)
    assert cli.main(["--target", server.target, "--json", "score", "--rows", "3"]) in (0, None)
    plain = json.loads(capsys.readouterr().out)["rows"]
    for row, with_extras in zip(plain, rows):
        assert "entropy" not in row and "top_ids" not in row
        assert row["logprob"] == with_extras["logprob"]
