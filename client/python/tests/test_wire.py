"""wire.py against the generated classes: a request written once from the
caller's memory is byte for byte the one protobuf serializes, for every
dtype and optional field; answers read into numpy hold what protobuf
parses. No server needed."""

import itertools
import math

import numpy as np
import pytest
from detlogp import calls, requests, tensors, wire
from detlogp._common import logprob_fields
from detlogp.v1 import detlogp_pb2 as pb

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None


def hidden_in(dtype, rows=5, hidden=7, seed=3):
    values = np.random.default_rng(seed).standard_normal((rows, hidden)) * 3
    if dtype == "bf16_bits":
        return tensors.float32_to_bf16_bits(values.astype(np.float32))
    if dtype == "bf16":
        if ml_dtypes is None:
            pytest.skip("ml_dtypes is not installed")
        return values.astype(np.float32).astype(ml_dtypes.bfloat16)
    return values.astype(dtype)


DTYPES = ["float32", "float16", "float64", "bf16_bits", "bf16", ">f4"]
OPTIONS = [
    dict(),
    dict(temperature=0.7, return_lse=True),
    dict(request_id="call-7", model="policy", version=12),
    dict(return_entropy=True, top_k=5),
    dict(temperature=-0.0, top_k=1, return_lse=True, return_entropy=True, version=2**40),
    dict(temperature=1e40, request_id="ü"),
    dict(temperature=math.nan),
]


def written_once(hidden, targets, **options):
    options = dict(options)
    fields = logprob_fields(
        options.pop("request_id", ""),
        options.pop("temperature", 0.0),
        options.pop("return_lse", False),
        options.pop("model", None),
        options.pop("version", None),
        options.pop("return_entropy", False),
        options.pop("top_k", 0),
        options.pop("timing", False),
    )
    return calls.LogProbCall(hidden, targets, fields).request_bytes()


@pytest.mark.parametrize(
    "dtype,options", list(itertools.product(DTYPES, range(len(OPTIONS)))), ids=str
)
def test_request_bytes_equal_protobufs(dtype, options):
    hidden = hidden_in(dtype)
    targets = [0, 1, 127, 128, 2**40]
    built = requests.logprob_request(hidden, targets, **OPTIONS[options])
    mine = written_once(hidden, targets, **OPTIONS[options])
    assert mine == built.SerializeToString()
    parsed = pb.LogProbRequest.FromString(mine)
    assert parsed.hidden.data == built.hidden.data
    assert list(parsed.target_ids) == targets


@pytest.mark.parametrize(
    "targets",
    [[], [0], [-1, 5], [2**63 - 1, -(2**63)], list(range(300)), np.arange(5, dtype=np.uint32)],
    ids=["none", "zero", "negative", "extremes", "300", "uint32"],
)
def test_target_ids_as_protobuf_writes_them(targets):
    rows = len(targets)
    hidden = np.ones((rows, 3), np.float32)
    built = requests.logprob_request(hidden, targets, temperature=1.0)
    assert written_once(hidden, targets, temperature=1.0) == built.SerializeToString()


def test_malformed_calls_go_whole_so_the_server_names_the_field():
    fields = logprob_fields("", 0.0, False, None, None, False, 0, False)
    for hidden, targets in [
        (np.zeros((2, 3, 4), np.float32), [0, 1]),  # rank 3
        (np.zeros((3, 4), np.float32), [0, 1]),  # a target missing
        (np.zeros(8, np.float32), [0]),  # rank 1
    ]:
        call = calls.LogProbCall(hidden, targets, fields)
        assert not call.well_formed
        route = calls.choose_route(
            call,
            calls.ServerLimits(max_request_rows=1),
            calls.TransferOptions(),
            1 << 30,
            True,
            "127.0.0.1:1",
        )
        assert route == calls.GRPCIO
        built = requests.logprob_request(hidden, targets)
        assert call.request_bytes() == built.SerializeToString()


def test_varints_round_trip():
    rng = np.random.default_rng(5)
    values = np.concatenate(
        [
            rng.integers(-(2**63), 2**63 - 1, 200, dtype=np.int64),
            rng.integers(0, 300, 200),
            np.array([0, 127, 128, 16383, 16384, -1, 2**63 - 1, -(2**63)]),
        ]
    ).astype(np.int64)
    data = wire.varints(values)
    assert data == b"".join(wire.varint(v) for v in values)
    np.testing.assert_array_equal(wire.read_varints(data), values)
    with pytest.raises(ValueError):
        wire.read_varints(b"\x80")


def random_response(rows, k, seed, lse=True, entropy=True, timing=True):
    rng = np.random.default_rng(seed)
    response = pb.LogProbResponse(
        request_id="abc",
        logprobs=rng.standard_normal(rows).astype(np.float32).tolist(),
        determinism_key="dk1-x",
        model="policy",
        model_version=7,
    )
    if lse:
        response.lse.extend(rng.standard_normal(rows).astype(np.float32).tolist())
    if entropy:
        response.entropy.extend(rng.standard_normal(rows).astype(np.float32).tolist())
    if k:
        response.top_ids.extend(rng.integers(0, 2**40, rows * k).tolist())
        response.top_logprobs.extend(rng.standard_normal(rows * k).astype(np.float32).tolist())
    if timing:
        response.timing.validate_us = 3
        response.timing.queue_us = 40
        response.timing.compute_us = 500
        response.timing.total_us = 600
    return response


@pytest.mark.parametrize("rows,k", [(0, 0), (1, 0), (17, 3), (1000, 20)])
def test_answers_read_into_numpy_hold_what_protobuf_parses(rows, k):
    response = random_response(rows, k, seed=rows + k)
    answer = wire.decode_logprob_response(response.SerializeToString())
    for name in ("request_id", "determinism_key", "model", "model_version"):
        assert getattr(answer, name) == getattr(response, name)
    for name, dtype in [
        ("logprobs", np.float32),
        ("lse", np.float32),
        ("entropy", np.float32),
        ("top_ids", np.int64),
        ("top_logprobs", np.float32),
    ]:
        want = np.array(getattr(response, name), dtype=dtype)
        got = getattr(answer, name)
        assert got.dtype == dtype
        assert got.tobytes() == want.tobytes(), name
    assert answer.timing == wire.ServerTiming(3, 40, 500, 600)


def test_unknown_and_unpacked_fields_are_read_as_protobuf_reads_them():
    response = random_response(3, 2, seed=1, timing=False)
    data = response.SerializeToString()
    # An unknown field (number 15, a string) and logprobs/top_ids again,
    # unpacked: protobuf appends them.
    extra = (
        (bytes([15 << 3 | 2, 2]) + b"hi" + bytes([2 << 3 | 5]) + np.float32(1.5).tobytes())
        + bytes([8 << 3 | 0])
        + wire.varint(-3)
    )
    merged = pb.LogProbResponse.FromString(data + extra)
    answer = wire.decode_logprob_response(data + extra)
    np.testing.assert_array_equal(answer.logprobs, np.array(merged.logprobs, np.float32))
    np.testing.assert_array_equal(answer.top_ids, np.array(merged.top_ids, np.int64))
    assert answer.unknown == {15: [b"hi"]}
    assert answer.timing is None
    with pytest.raises(ValueError):
        wire.decode_logprob_response(data[:-1])


def test_large_requests_are_joined_without_the_gil_and_equal_protobufs():
    """A request past bytes_join's threshold is written by the GIL-free
    writer (CPython) and is still protobuf's bytes."""
    from detlogp import bytes_join

    assert bytes_join._WRITER is not None, "the GIL-free writer failed its self-check"
    rows, hidden = 160, 4096  # 1.25 MiB of bf16 rows
    bits = tensors.float32_to_bf16_bits(
        np.random.default_rng(5).standard_normal((rows, hidden)).astype(np.float32)
    )
    targets = list(range(0, rows * 997, 997))
    options = dict(temperature=0.5, return_lse=True, model="m", version=3, top_k=4)
    mine = written_once(bits, targets, **options)
    assert len(mine) >= bytes_join.GIL_FREE_MIN_BYTES
    assert mine == requests.logprob_request(bits, targets, **options).SerializeToString()


@pytest.mark.parametrize("threshold", [0, 1 << 62])
def test_bytes_join_equals_bytes_join_of_python(monkeypatch, threshold):
    from detlogp import bytes_join

    monkeypatch.setattr(bytes_join, "GIL_FREE_MIN_BYTES", threshold)
    array = np.arange(1000, dtype=np.uint16)
    read_only = memoryview(array.tobytes())
    parts = [b"head", memoryview(array).cast("B"), b"", read_only, bytearray(b"tail")]
    joined = bytes_join.join(parts)
    assert type(joined) is bytes
    assert joined == b"".join(parts)
    assert hash(joined) == hash(b"".join(parts))
    assert bytes_join.join([]) == b""
