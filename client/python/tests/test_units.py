"""Client pieces that need no server: dtype packing, bf16 rounding, the
safetensors writer, retry policy, error mapping, Project reassembly."""

import random

import grpc
import numpy as np
import pytest
from detlogp import errors, requests, safetensors_io, status_details, tensors, wire
from detlogp.retry import RetryPolicy, is_retryable, queue_full_delay
from detlogp.v1 import detlogp_pb2 as pb

ml_dtypes = pytest.importorskip("ml_dtypes")


def test_bf16_rounding_matches_ml_dtypes_including_ties_and_specials():
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(100000).astype(np.float32) * 10.0,
            np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, 3.4e38, 65504.0], np.float32),
            # exact ties: low 16 bits 0x8000, even and odd upper halves
            np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32).view(np.float32),
        ]
    )
    ours = tensors.float32_to_bf16_bits(values)
    theirs = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(ours, theirs)
    assert np.isnan(
        tensors.bf16_bits_to_float32(tensors.float32_to_bf16_bits(np.array([np.nan], np.float32)))
    ).all()


@pytest.mark.parametrize(
    "dtype,wire",
    [
        (np.float32, pb.DTYPE_FLOAT32),
        (np.float16, pb.DTYPE_FLOAT16),
        (np.uint16, pb.DTYPE_BFLOAT16),
        (ml_dtypes.bfloat16, pb.DTYPE_BFLOAT16),
    ],
)
def test_to_tensor_packs_little_endian_row_major(dtype, wire):
    array = np.arange(6).reshape(2, 3).astype(dtype)
    tensor = tensors.to_tensor(array)
    assert tensor.dtype == wire and list(tensor.shape) == [2, 3]
    back = tensors.from_tensor(tensor)
    assert np.array_equal(
        np.asarray(back).view(np.uint8).reshape(-1),
        np.ascontiguousarray(array).view(np.uint8).reshape(-1),
    )


def test_to_tensor_handles_big_endian_and_non_contiguous():
    array = np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2]
    tensor = tensors.to_tensor(array)
    assert np.array_equal(np.frombuffer(tensor.data, "<f4").reshape(3, 2), array)


def test_to_tensor_refuses_integers():
    with pytest.raises(TypeError):
        tensors.to_tensor(np.zeros((1, 2), np.int32))


def test_safetensors_round_trip(tmp_path):
    arrays = {
        "w": tensors.float32_to_bf16_bits(np.ones((3, 5), np.float32)),
        "b": np.arange(3, dtype=np.float32),
        "h": np.ones(7, np.float16),
    }
    path = tmp_path / "x.safetensors"
    safetensors_io.write(path, arrays)
    blob = path.read_bytes()
    assert int.from_bytes(blob[:8], "little") % 8 == 0
    back = safetensors_io.read(path)
    for name, array in arrays.items():
        assert np.array_equal(back[name], array)


def test_backoff_is_jittered_exponential_and_capped():
    policy = RetryPolicy(max_attempts=10, initial_backoff_s=0.1, max_backoff_s=1.0)
    rng = random.Random(1)
    for index in range(8):
        cap = min(1.0, 0.1 * 2**index)
        draws = [policy.backoff(index, rng) for _ in range(200)]
        assert all(0 <= d <= cap for d in draws)
        assert max(draws) > 0.8 * cap  # jitter spans the range


def _field(number, payload):
    return wire._len_field(number, len(payload)) + payload


def _any(name, message):
    return _field(1, f"type.googleapis.com/google.rpc.{name}".encode()) + _field(2, message)


def _queue_full_details():
    """A google.rpc.Status as the server sends it for a full queue, with a
    BadRequest too, encoded field by field."""
    info = (
        _field(1, b"QUEUE_FULL")
        + _field(2, b"detlogp.v1")
        + _field(3, _field(1, b"limit") + _field(2, b"64"))
        + _field(3, _field(1, b"requested") + _field(2, b"32"))
    )
    retry = _field(1, wire._int(1, 1) + wire._int(2, 250_000_000))
    bad = _field(1, _field(1, b"hidden") + _field(2, b"why"))
    return (
        wire._int(1, 8)
        + _field(2, b"queue full")
        + _field(3, _any("ErrorInfo", info))
        + _field(3, _any("RetryInfo", retry))
        + _field(3, _any("BadRequest", bad))
        + _field(3, _any("Unknown", b"\x08\x01"))
    )


def test_status_details_are_decoded_from_the_wire():
    said = status_details.decode(_queue_full_details())
    assert said.reason == "QUEUE_FULL" and said.domain == "detlogp.v1"
    assert said.metadata == {"limit": "64", "requested": "32"}
    assert said.retry_delay_s == pytest.approx(1.25)
    assert said.fields == ["hidden"]
    # Nothing, or bytes that are not a status: no details.
    assert status_details.decode(b"") == status_details.StatusDetails()
    assert status_details.decode(b"\xff\xff") == status_details.StatusDetails()
    trailers = (("other", "x"), (status_details.TRAILER, _queue_full_details()))
    assert status_details.from_trailing_metadata(trailers).reason == "QUEUE_FULL"


def test_errors_decide_from_the_details_never_the_message():
    invalid = errors.InvalidArgument(
        "target_ids[3]: 5000 is outside [0, 1000)",
        status_details=status_details.StatusDetails(
            reason="INVALID_FIELD", fields=["target_ids[3]"]
        ),
    )
    assert invalid.field == "target_ids[3]" and invalid.reason == "INVALID_FIELD"
    assert not is_retryable(invalid) and queue_full_delay(invalid) is None
    # A message naming a field, without details, names none.
    assert errors.InvalidArgument("hidden.shape[1]: H=3 ...").field is None
    assert errors.InvalidArgument("x").reason == "INVALID_ARGUMENT"
    full = errors.from_status(8, "queue full", _queue_full_details())
    assert isinstance(full, errors.Overloaded) and full.queue_full and full.limit == 64
    assert full.metadata["requested"] == "32" and full.retry_delay_s == pytest.approx(1.25)
    assert is_retryable(full)
    assert 1.25 <= queue_full_delay(full) <= 1.25 * 1.5
    # "queue full" text alone is not a full queue.
    assert not errors.Overloaded("queue full: 9 rows queued").queue_full
    # A full queue the request can never fit (no RetryInfo): not retried.
    never = errors.Overloaded(
        "queue full", status_details=status_details.StatusDetails(reason="QUEUE_FULL")
    )
    assert queue_full_delay(never) is None
    assert not is_retryable(errors.Overloaded("Received message larger than max"))
    assert is_retryable(errors.Unavailable("down", grpc.StatusCode.UNAVAILABLE))
    assert not is_retryable(errors.DeadlineExceeded("late", grpc.StatusCode.DEADLINE_EXCEEDED))


def test_project_assembler_reorders_chunks_and_detects_gaps():
    y = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    chunks = [(6, y[6:10]), (0, y[0:3]), (3, y[3:6])]
    assembler = requests.ProjectAssembler(10)
    for offset, rows in chunks:
        assembler.add(
            pb.ProjectResponse(row_offset=offset, y=tensors.to_tensor(rows), determinism_key="k")
        )
    result = assembler.result()
    assert np.array_equal(result.y, y) and result.chunks == 3 and result.determinism_key == "k"
    gap = requests.ProjectAssembler(10)
    gap.add(pb.ProjectResponse(row_offset=0, y=tensors.to_tensor(y[:3])))
    with pytest.raises(errors.DetlogpError, match="7 rows missing"):
        gap.result()
    with pytest.raises(errors.DetlogpError, match="overlaps"):
        gap.add(pb.ProjectResponse(row_offset=2, y=tensors.to_tensor(y[2:4])))


def test_interleaved_projection_puts_blocks_back_and_checks_each():
    x = np.arange(10 * 96, dtype=np.float32).reshape(10, 96)
    plan = requests.InterleavedProjection(x, 3, 2, "v")  # blocks 3, 3, 3, 1
    assert (plan.calls, plan.blocks) == (2, 4)
    assert [int(r.x.shape[0]) for r in plan.requests] == [6, 4]
    assert [r.request_id for r in plan.requests] == ["v/1of2", "v/2of2"]
    assert np.array_equal(
        np.frombuffer(plan.requests[1].x.data, np.float32).reshape(4, 96),
        np.concatenate([x[3:6], x[9:10]]),
    )
    y = np.arange(10 * 5376, dtype=np.float32).reshape(10, 5376)

    def chunk(offset, rows, key="k"):
        return pb.ProjectResponse(row_offset=offset, y=tensors.to_tensor(rows), determinism_key=key)

    plan.add(1, chunk(0, y[3:6]))
    plan.add(0, chunk(0, y[0:3]))
    plan.add(1, chunk(3, y[9:10]))
    with pytest.raises(errors.DataLoss, match="row_offset"):
        plan.add(0, chunk(0, y[6:9]))  # call 0's second block is at its row 3
    with pytest.raises(errors.DataLoss, match="Project call 0 ended after 1"):
        plan.result()
    with pytest.raises(errors.DataLoss, match="y.shape"):
        plan.add(0, chunk(3, y[6:8]))  # not the whole block
    plan.add(0, chunk(3, y[6:9]))
    result = plan.result()
    assert np.array_equal(result.y, y) and result.chunks == 4
    assert result.determinism_key == "k"
    other = requests.InterleavedProjection(x, 5, 2)
    other.add(0, chunk(0, y[0:5], key="a"))
    other.add(1, chunk(0, y[5:10], key="b"))
    with pytest.raises(errors.DataLoss, match="determinism_key"):
        other.result()
    assert requests.InterleavedProjection.count_calls(10, 0, 4) == 1  # one block of 512
    with pytest.raises(ValueError, match="streams"):
        requests.InterleavedProjection.count_calls(10, 3, -1)
    # streams=0: by the projection's size.
    assert requests.InterleavedProjection.count_calls(8191, 0, 0) == 1
    assert requests.InterleavedProjection.count_calls(8192, 0, 0) == 4
    assert requests.InterleavedProjection.count_calls(8192, 4096, 0) == 2  # two blocks


def test_keep_freed_memory_sets_glibc_malloc_and_checks_its_argument():
    import detlogp

    assert detlogp.keep_freed_memory(64) is True  # Linux with glibc
    for bad in (0, -1, 2048):
        with pytest.raises(ValueError, match="keep_freed_memory"):
            detlogp.keep_freed_memory(bad)


def _route(rows, hidden, *, limits=None, engine=True, target="10.0.0.1:50051", **options):
    from detlogp import calls
    from detlogp._common import logprob_fields

    fields = logprob_fields("", 0.0, False, None, None, False, 0, False)
    call = calls.LogProbCall(np.zeros((rows, hidden), np.uint16), np.zeros(rows), fields)
    known = limits if limits is not None else calls.ServerLimits(max_request_rows=64)
    chosen = calls.choose_route(
        call,
        known,
        calls.TransferOptions(**options),
        256 << 20,
        engine,
        target,
    )
    return chosen


def test_the_path_of_a_call_is_chosen_from_the_call_and_the_limits_alone():
    from detlogp import calls

    GRPCIO, ENGINE = calls.GRPCIO, calls.ENGINE
    assert _route(64, 128) == GRPCIO  # one request's worth
    assert _route(65, 128) == ENGINE  # over the server's rows
    assert _route(64, 8192) == ENGINE  # 1 MiB: spread over connections
    assert _route(64, 8192, engine_min_bytes=2 << 20) == GRPCIO
    # A server on this host: from 64 KiB, through the engine's region.
    assert _route(64, 512, target="unix:/tmp/s") == ENGINE
    assert _route(64, 511, target="unix:/tmp/s") == GRPCIO
    assert _route(64, 512, target="127.0.0.1:1", shared_memory="off") == GRPCIO
    # A server that does not say has the defaults.
    assert _route(100, 4, limits=calls.ServerLimits.tightest([None])) == GRPCIO
    assert _route(65537, 4, limits=calls.ServerLimits.tightest([None])) == ENGINE
    tight = calls.ServerLimits.tightest([None, calls.ServerLimits(max_request_rows=8)])
    assert tight.max_request_rows == 8 and _route(9, 4, limits=tight) == ENGINE
    # Over the message limit, and no engine: said, never sent.
    small = calls.ServerLimits(max_request_rows=1 << 20, max_message_bytes=1 << 20)
    with pytest.raises(calls.EngineRequired, match="libdetlogp_client.so"):
        _route(1000, 1024, limits=small, engine=False)
    assert _route(1000, 1024, limits=small) == ENGINE
    assert _route(0, 4) == GRPCIO


def test_same_host_targets_are_unix_sockets_and_loopback_addresses():
    from detlogp.calls import is_same_host

    for target in (
        "unix:/tmp/s",
        "127.0.0.1:5",
        "localhost:5",
        "[::1]:5",
        "ipv4:127.0.0.1:1,127.0.0.2:2",
    ):
        assert is_same_host(target), target
    for target in ("10.0.0.1:5", "dns:///detlogp.svc:5", "ipv4:127.0.0.1:1,10.0.0.2:2"):
        assert not is_same_host(target), target
