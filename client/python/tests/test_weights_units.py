"""Live-weights client pieces that need no server: the upload's bf16 bytes and
digest, its message stream, combining replicas' answers, moving past a
replica that lacks a pinned version, the admin token's metadata."""

import hashlib
import subprocess
import sys

import detlogp
import grpc
import numpy as np
import pytest
from detlogp import _common, credentials, errors, weights
from detlogp.v1 import detlogp_pb2 as pb

ml_dtypes = pytest.importorskip("ml_dtypes")


def _specials():
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32) * 3.0,
            np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-41, 3.4e38, 65504.0], np.float32),
            # exact ties, even and odd upper halves, and a NaN with a payload
            np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7FA00001], np.uint32).view(np.float32),
        ]
    )
    return values.reshape(-1, 4)  # [V, H]: 5012 values


def test_float32_weights_round_like_the_server_and_ml_dtypes():
    values = _specials()
    bits = weights.weight_bits(values)
    assert bits.dtype == np.dtype("<u2") and bits.shape == values.shape
    assert np.array_equal(bits, weights.tensors.float32_to_bf16_bits(values))
    finite = ~np.isnan(values)
    assert np.array_equal(bits[finite], values[finite].astype(ml_dtypes.bfloat16).view(np.uint16))


def test_rounding_in_blocks_equals_rounding_at_once(monkeypatch):
    values = np.random.default_rng(1).standard_normal((37, 16)).astype(np.float32)
    whole = weights.weight_bits(values)
    monkeypatch.setattr(weights, "_ROUND_BLOCK_ELEMENTS", 50)  # 3 rows a block
    assert np.array_equal(weights.weight_bits(values), whole)


def test_float16_float64_big_endian_and_strided_weights():
    values = np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32)
    want16 = weights.tensors.float32_to_bf16_bits(values.astype(np.float16).astype(np.float32))
    assert np.array_equal(weights.weight_bits(values.astype(np.float16)), want16)
    assert np.array_equal(
        weights.weight_bits(values.astype(np.float64)), weights.weight_bits(values)
    )
    assert np.array_equal(weights.weight_bits(values.astype(">f4")), weights.weight_bits(values))
    wide = np.random.default_rng(3).standard_normal((16, 16)).astype(np.float32)
    assert np.array_equal(
        weights.weight_bits(wide[:, ::2]), weights.weight_bits(np.ascontiguousarray(wide[:, ::2]))
    )


def test_bf16_weights_are_sent_without_a_copy():
    bits = weights.tensors.float32_to_bf16_bits(
        np.random.default_rng(4).standard_normal((8, 8)).astype(np.float32)
    )
    assert np.shares_memory(weights.weight_bits(bits), bits)
    as_bf16 = bits.view(ml_dtypes.bfloat16)
    assert np.shares_memory(weights.weight_bits(as_bf16), bits)
    big_endian = bits.astype(">u2")
    assert np.array_equal(weights.weight_bits(big_endian), bits)
    head = weights.LmHead(bits)
    assert np.shares_memory(np.frombuffer(head._buffers()[0], np.uint16), bits)


def test_refused_weights_and_biases():
    with pytest.raises(TypeError):
        weights.weight_bits(np.zeros((4, 8), np.int32))
    with pytest.raises(ValueError, match="padded_vocab_size, hidden_size"):
        weights.LmHead(np.zeros((4, 8, 2), np.float32))
    with pytest.raises(ValueError, match=r"expected \[4\]"):
        weights.LmHead(np.zeros((4, 8), np.float32), np.zeros(5, np.float32))
    with pytest.raises(TypeError):
        weights.LmHead(np.zeros((4, 8), np.float32), np.zeros(4, np.int64))


def _sha(data):
    return hashlib.sha256(data).digest()


def test_digest_is_the_documented_block_digest():
    bits = weights.tensors.float32_to_bf16_bits(
        np.random.default_rng(5).standard_normal((24, 8)).astype(np.float32)
    )
    bias = np.random.default_rng(6).standard_normal(24)  # float64: sent as fp32
    head = weights.LmHead(bits, bias, vocab_size=20)
    # One block each: the leaves are the weight's and the bias's SHA-256.
    want = hashlib.sha256(
        b"detlogp-lm-head-v2 H=8 V=20 V_pad=24 bias=1 block=16777216\n"
        + _sha(bits.astype("<u2").tobytes())
        + _sha(bias.astype("<f4").tobytes())
    ).hexdigest()
    assert head.sha256() == want == detlogp.lm_head_sha256(bits, bias, 20)
    no_bias = hashlib.sha256(
        b"detlogp-lm-head-v2 H=8 V=24 V_pad=24 bias=0 block=16777216\n" + _sha(bits.tobytes())
    ).hexdigest()
    assert weights.LmHead(bits).sha256() == no_bias
    assert weights.LmHead(bits, vocab_size=24).sha256() == no_bias  # 24 == all rows


def test_digest_cuts_16_mib_blocks_from_each_part():
    rows, hidden = 4100, 4096  # 32.03 MiB of weight: blocks of 16, 16, 0.03 MiB
    bits = np.random.default_rng(8).integers(0, 1 << 16, (rows, hidden), dtype=np.uint16)
    bias = np.arange(rows, dtype=np.float32)
    raw = bits.tobytes()
    block = 16 << 20
    leaves = b"".join(_sha(raw[i : i + block]) for i in range(0, len(raw), block))
    want = hashlib.sha256(
        f"detlogp-lm-head-v2 H={hidden} V={rows} V_pad={rows} bias=1 block={block}\n".encode()
        + leaves
        + _sha(bias.tobytes())
    ).hexdigest()
    assert weights.LmHead(bits, bias).sha256() == want
    assert (
        weights.block_digest(
            weights.LmHead(bits, bias).preamble(), weights.LmHead(bits, bias)._buffers(), threads=1
        )
        == want
    )


@pytest.mark.parametrize("chunk_bytes", [1, 100, 384, 1 << 20])
def test_messages_are_header_with_digest_then_chunks(chunk_bytes):
    bits = weights.tensors.float32_to_bf16_bits(
        np.random.default_rng(7).standard_normal((24, 8)).astype(np.float32)
    )
    bias = np.arange(24, dtype=np.float32)
    head = weights.LmHead(bits, bias, vocab_size=21)
    messages = list(head.messages("policy", chunk_bytes=chunk_bytes))
    first, rest = messages[0], messages[1:]
    assert first.WhichOneof("part") == "header"
    assert first.header == pb.UploadModelHeader(
        model="policy",
        dtype=pb.DTYPE_BFLOAT16,
        shape=[24, 8],
        vocab_size=21,
        has_bias=True,
        weights_sha256=head.sha256(),
    )
    assert all(m.WhichOneof("part") == "chunk" and 0 < len(m.chunk) <= chunk_bytes for m in rest)
    assert b"".join(m.chunk for m in rest) == bits.tobytes() + bias.tobytes()
    claimed = list(head.messages("policy", chunk_bytes, weights_sha256="ab" * 32))
    assert claimed[0].header.weights_sha256 == "ab" * 32
    with pytest.raises(ValueError):
        list(head.messages("policy", chunk_bytes=0))


def test_torch_is_not_imported_by_the_package():
    code = (
        "import sys, numpy, detlogp, detlogp.weights, detlogp.cli;"
        "detlogp.LmHead(numpy.zeros((8, 8), numpy.float32)).sha256();"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _status(version, key, sha="s"):
    return pb.ModelVersionStatus(version=version, determinism_key=key, weights_sha256=sha)


def test_combining_replicas_answers():
    same = {"a:1": _status(3, "dk1-x"), "b:2": _status(3, "dk1-x")}
    result = _common.combine_versions("policy", same)
    assert (result.model, result.version, result.determinism_key) == ("policy", 3, "dk1-x")
    assert list(result.per_target) == ["a:1", "b:2"] and result.status.version == 3
    with pytest.raises(errors.ReplicaMismatch, match="determinism_keys") as error:
        _common.combine_versions("policy", {"a:1": _status(3, "dk1-x"), "b:2": _status(3, "dk1-y")})
    assert set(error.value.results) == {"a:1", "b:2"}
    assert "a:1: dk1-x" in str(error.value) and "b:2: dk1-y" in str(error.value)
    with pytest.raises(errors.ReplicaMismatch, match="versions"):
        _common.combine_versions("policy", {"a:1": _status(3, "k"), "b:2": _status(4, "k")})


def test_first_failure_names_where_it_failed_and_what_succeeded():
    failed = errors.DataLoss("weights_sha256: mismatch", field="weights_sha256")
    outcomes = {"a:1": _status(2, "k"), "b:2": failed}
    error = _common.first_failure("policy", "UploadModel", outcomes)
    assert error is failed and error.per_target == outcomes
    assert "on b:2; succeeded on: a:1" in str(error) and error.field == "weights_sha256"
    assert _common.first_failure("policy", "UploadModel", {"a:1": _status(2, "k")}) is None


class _State:
    def __init__(self, targets, retry=detlogp.RetryPolicy()):
        self.targets = targets
        self.timeout = 5.0
        self.retry = retry
        self.retries = 0
        self._rr = _common.RoundRobin(len(targets))


def test_call_plan_moves_past_not_found_once_per_target():
    state = _State(["a", "b", "c"])
    state._rr.next()  # the plan starts at target 1
    plan = _common.CallPlan(state, None, retry_not_found=True)
    not_found = errors.NotFound("model_version: no", grpc.StatusCode.NOT_FOUND)
    visited = [plan.index]
    while (pause := plan.after(not_found)) is not None:
        assert pause == 0.0
        visited.append(plan.index)
    assert visited == [1, 2, 0] and state.retries == 2
    # Without a pinned version NOT_FOUND is final.
    plan = _common.CallPlan(_State(["a", "b"]), None, retry_not_found=False)
    assert plan.after(not_found) is None
    # UNAVAILABLE is still retried with backoff.
    plan = _common.CallPlan(_State(["a", "b"]), None, retry_not_found=True)
    assert plan.after(errors.Unavailable("down", grpc.StatusCode.UNAVAILABLE)) is not None


def test_new_status_codes_map_to_typed_errors():
    cases = {
        grpc.StatusCode.NOT_FOUND: errors.NotFound,
        grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
        grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
        grpc.StatusCode.DATA_LOSS: errors.DataLoss,
        grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    }

    class Fake(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "model_version: model 'p' has no ready version 9"

    for code, cls in cases.items():
        error = errors.from_rpc_error(Fake(code))
        assert type(error) is cls and error.code == code
        # No trailers: no details, whatever the message says.
        assert error.field is None and error.reason == code.name
    assert errors.PermissionDenied("path: '/x' is absolute", field="path").field == "path"


def test_scoring_token_is_left_off_calls_that_carry_the_admin_token():
    class Details:
        method, timeout, credentials, wait_for_ready, compression = "/m", 1.0, None, None, None

        def __init__(self, metadata):
            self.metadata = metadata

    plain = credentials._with_token(Details(None), "score")
    assert list(plain.metadata) == [("authorization", "Bearer score")]
    admin = credentials._with_token(Details(credentials.bearer("admin")), "score")
    assert list(admin.metadata) == [("authorization", "Bearer admin")]
