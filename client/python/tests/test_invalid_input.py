"""Each malformed request gets INVALID_ARGUMENT naming its field, raised as
InvalidArgument at once (never retried)."""

import math

import detlogp
import numpy as np
import pytest
from detlogp.v1 import detlogp_pb2 as pb


def raw_request(model, rows=2, **overrides):
    """A valid fp32 request with some fields overridden."""
    hidden = np.zeros((rows, model.hidden), np.float32)
    fields = dict(
        hidden=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[rows, model.hidden], data=hidden.tobytes()),
        target_ids=list(range(rows)),
        temperature=1.0,
    )
    fields.update(overrides)
    return pb.LogProbRequest(**fields)


def cases(model, max_request_rows):
    h = model.hidden
    fp32 = lambda shape, nbytes: pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, data=b"\0" * nbytes)
    too_many = max_request_rows + 1
    return {
        "dtype unspecified": (
            "hidden.dtype",
            raw_request(
                model,
                hidden=pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[2, h], data=b"\0" * 8 * h),
            ),
        ),
        "dtype out of enum": (
            "hidden.dtype",
            raw_request(model, hidden=pb.Tensor(dtype=77, shape=[2, h], data=b"\0" * 8 * h)),
        ),
        "rank 1": ("hidden.shape", raw_request(model, hidden=fp32([2 * h], 8 * h))),
        "rank 3": ("hidden.shape", raw_request(model, hidden=fp32([1, 2, h], 8 * h))),
        "wrong H": ("hidden.shape[1]", raw_request(model, hidden=fp32([2, h + 1], 8 * (h + 1)))),
        "negative N": ("hidden.shape[0]", raw_request(model, hidden=fp32([-1, h], 0))),
        "too many rows": (
            "hidden.shape[0]",
            raw_request(
                model, hidden=fp32([too_many, h], 4 * too_many * h), target_ids=[0] * too_many
            ),
        ),
        "short data": ("hidden.data", raw_request(model, hidden=fp32([2, h], 8 * h - 1))),
        "long data": ("hidden.data", raw_request(model, hidden=fp32([2, h], 8 * h + 4))),
        "missing target": ("target_ids", raw_request(model, target_ids=[0])),
        "extra target": ("target_ids", raw_request(model, target_ids=[0, 1, 2])),
        "negative target": ("target_ids[1]", raw_request(model, target_ids=[0, -1])),
        "target = vocab": ("target_ids[0]", raw_request(model, target_ids=[model.vocab, 0])),
        "target in padding": (
            "target_ids[1]",
            raw_request(model, target_ids=[0, model.padded_vocab - 1]),
        ),
        "huge target": ("target_ids[0]", raw_request(model, target_ids=[2**62, 0])),
        "nan temperature": ("temperature", raw_request(model, temperature=math.nan)),
        "inf temperature": ("temperature", raw_request(model, temperature=math.inf)),
        "negative temperature": ("temperature", raw_request(model, temperature=-0.5)),
    }


CASE_NAMES = [
    "dtype unspecified",
    "dtype out of enum",
    "rank 1",
    "rank 3",
    "wrong H",
    "negative N",
    "too many rows",
    "short data",
    "long data",
    "missing target",
    "extra target",
    "negative target",
    "target = vocab",
    "target in padding",
    "huge target",
    "nan temperature",
    "inf temperature",
    "negative temperature",
]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_invalid_request_names_its_field(client, model, max_request_rows, case):
    field, request = cases(model, max_request_rows)[case]
    attempts_before = client.attempts
    with pytest.raises(detlogp.InvalidArgument) as info:
        client.compute(request)
    error = info.value
    print(f"{case}: {error.details}")
    assert error.field == field, error.details
    assert error.details.startswith(field + ":")
    assert client.attempts - attempts_before == 1  # never retried


def test_invalid_request_on_a_stream_ends_it_with_invalid_argument(client, model):
    good = raw_request(model)
    bad = raw_request(model, target_ids=[0, model.vocab])
    answers = []
    with pytest.raises(detlogp.InvalidArgument) as info:
        for answer in client.stream([good, bad, good]):
            answers.append(answer)
    assert info.value.field == "target_ids[1]"
    assert len(answers) == 1


def test_bytes_that_are_not_a_request_are_invalid_argument_naming_it(server, model):
    """Unary and on a stream: the server reads requests from gRPC's bytes
    itself, so bytes protobuf cannot parse are the caller's error, named."""
    import grpc
    from detlogp.testing import raw_logprob_methods

    good = raw_request(model).SerializeToString()
    # hidden (field 1, length-delimited) claiming more bytes than follow.
    truncated = good[:40]
    not_protobuf = b"\xff\xff\xff\xff"
    with grpc.insecure_channel(server.target) as channel:
        unary, stream = raw_logprob_methods(channel)
        for bad in (truncated, not_protobuf):
            with pytest.raises(grpc.RpcError) as info:
                unary(bad, timeout=20)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("LogProbRequest: not a valid message")
            answers = []
            with pytest.raises(grpc.RpcError) as info:
                for answer in stream(iter([good, bad, good]), timeout=20):
                    answers.append(answer)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("LogProbRequest: not a valid message")
            assert len(answers) == 1
            assert pb.LogProbResponse.FromString(answers[0]).logprobs


def test_client_side_type_errors_are_raised_before_sending(client, model):
    with pytest.raises(TypeError):
        client.logprobs(np.zeros((1, model.hidden), np.int32), [0])
