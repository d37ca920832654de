"""LogProbRequest and LogProbResponse in protobuf's wire format, written and
read without the generated classes.

Building a request through the generated class copies the hidden bytes
twice (into the message, then into the serialized string); a large call
spends more time there than on the server. `encode_logprob_request` writes
the serialized request once: the fields before `hidden.data`, then the
caller's rows straight from their buffer, then the fields after it, joined
into one bytes object (one copy of the rows, made without the GIL:
bytes_join.py). The bytes are the ones
`pb.LogProbRequest(...).SerializeToString()` gives for the same fields
(tests/test_wire.py checks it field by field), so the server cannot tell the
two apart.

`decode_logprob_response` reads an answer's packed floats and ids straight
into numpy arrays (np.frombuffer), skipping fields it does not know, as a
protobuf parser does.
"""

import dataclasses
from typing import Optional

import numpy as np

from detlogp import bytes_join

# Wire types.
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


def _tag(field, wire_type):
    return bytes([(field << 3) | wire_type])  # fields < 16: one byte


def varint(value):
    """One varint: a negative int64 takes ten bytes (its two's complement),
    as protobuf writes int64."""
    value = int(value)
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def varints(values):
    """Packed varints of an int64 array (protobuf's packed repeated int64)."""
    unsigned = np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)
    if unsigned.size == 0:
        return b""
    top = int(unsigned.max())
    if top < 0x80:
        return unsigned.astype(np.uint8).tobytes()
    # The 7-bit groups of every value, low first ([groups, n]); only as many
    # groups as the largest value has.
    groups = (top.bit_length() + 6) // 7
    shifted = unsigned[None, :] >> (np.arange(groups, dtype=np.uint64)[:, None] * np.uint64(7))
    lengths = np.maximum(np.count_nonzero(shifted, axis=0), 1)
    group = np.arange(groups)[:, None]
    out = (shifted & np.uint64(0x7F)).astype(np.uint8)
    out[group < lengths[None, :] - 1] |= 0x80
    return out.T[(group < lengths[None, :]).T].tobytes()


def read_varints(data):
    """The int64 values of packed varints (a bytes-like object)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size == 0:
        return np.empty(0, np.int64)
    if raw[-1] & 0x80:
        raise ValueError("packed varints end inside a value")
    last = (raw & 0x80) == 0
    if last.all():
        return raw.astype(np.int64)
    ends = np.flatnonzero(last)
    starts = np.concatenate(([0], ends[:-1] + 1))
    group = np.arange(raw.size) - np.repeat(starts, ends - starts + 1)
    if int(group.max()) > 9:
        raise ValueError("a varint longer than ten bytes")
    parts = (raw & 0x7F).astype(np.uint64) << (7 * group).astype(np.uint64)
    return np.add.reduceat(parts, starts).view(np.int64)


def _len_field(field, payload_size):
    return _tag(field, _LEN) + varint(payload_size)


def _string(field, text):
    if not text:
        return b""
    data = text.encode("utf-8")
    return _len_field(field, len(data)) + data


def _int(field, value):
    return _tag(field, _VARINT) + varint(value) if value else b""


def _bool(field, value):
    return _tag(field, _VARINT) + b"\x01" if value else b""


@dataclasses.dataclass(frozen=True)
class RequestFields:
    """A LogProbRequest's fields other than hidden and target_ids."""

    request_id: str = ""
    temperature: float = 0.0
    return_lse: bool = False
    model: str = ""
    model_version: int = 0
    return_entropy: bool = False
    top_k: int = 0
    return_timing: bool = False


def tensor_bytes(dtype, shape, data=None):
    """A Tensor message's parts: a list of bytes-like objects whose join is
    the serialized Tensor. `data` (a buffer) is passed through, not copied."""
    parts = [_int(1, dtype)]
    dims = b"".join(varint(d) for d in shape)
    if dims:
        parts.append(_len_field(2, len(dims)) + dims)
    if data is not None:
        if isinstance(data, np.ndarray):  # C-contiguous: no copy
            view = memoryview(data.reshape(-1).view(np.uint8))
        else:
            view = memoryview(data).cast("B")
        if view.nbytes:
            parts.append(_len_field(3, view.nbytes))
            parts.append(view)
    return parts


def encode_logprob_request(fields, dtype, shape, target_ids, data=None):
    """The serialized LogProbRequest: `fields` (RequestFields), the hidden
    tensor (a DType number, its shape and `data`, a buffer of little-endian
    rows), and target_ids (int64 array). The rows are copied once, into the
    returned bytes."""
    tensor = tensor_bytes(dtype, shape, data)
    tensor_size = sum(memoryview(p).nbytes for p in tensor)
    ids = varints(target_ids)
    head = _string(1, fields.request_id) + _len_field(2, tensor_size)
    tail = [_len_field(3, len(ids)) + ids if ids else b""]
    with np.errstate(over="ignore"):  # as protobuf: beyond float32 is inf
        temperature = np.float32(fields.temperature).astype("<f4").tobytes()
    if temperature != b"\0\0\0\0":
        tail.append(_tag(4, _FIXED32) + temperature)
    tail += [
        _bool(5, fields.return_lse),
        _string(6, fields.model),
        _int(7, fields.model_version),
        _bool(8, fields.return_entropy),
        _int(9, fields.top_k),
        _bool(10, fields.return_timing),
    ]
    return bytes_join.join([head, *tensor, *tail])


@dataclasses.dataclass
class LogProbAnswer:
    """A decoded LogProbResponse: the generated message's field names, with
    numpy arrays for the repeated fields. Fields this client does not know
    are kept by number in `unknown` ({field: [raw values]})."""

    request_id: str = ""
    logprobs: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.float32))
    lse: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.float32))
    determinism_key: str = ""
    model: str = ""
    model_version: int = 0
    entropy: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.float32))
    top_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    top_logprobs: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.float32))
    timing: Optional["ServerTiming"] = None
    unknown: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class ServerTiming:
    """LogProbResponse.timing: where the call's time went on the server,
    microseconds (validation and shared-memory reads, queue, compute, and
    arrival to answer)."""

    validate_us: int = 0
    queue_us: int = 0
    compute_us: int = 0
    total_us: int = 0


def decode_server_timing(data):
    values = {1: 0, 2: 0, 3: 0, 4: 0}
    for field, wire_type, value in iter_fields(data):
        if field in values and wire_type == _VARINT:
            values[field] = _signed(value)
    return ServerTiming(values[1], values[2], values[3], values[4])


_STRINGS = {1: "request_id", 4: "determinism_key", 5: "model"}
_FLOATS = {2: "logprobs", 3: "lse", 7: "entropy", 9: "top_logprobs"}
_INT64S = {8: "top_ids"}
_INTS = {6: "model_version"}


def _read_varint(view, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(view):
            raise ValueError("message ends inside a varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than ten bytes")


def _signed(value):
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def iter_fields(data):
    """(field, wire_type, value) of each field of a serialized message: an
    int for varints and fixed fields, a memoryview for length-delimited
    ones. Groups (deprecated) raise ValueError."""
    view = memoryview(data).cast("B")
    pos, end = 0, len(view)
    while pos < end:
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(view, pos)
        elif wire_type == _FIXED64:
            value, pos = bytes(view[pos : pos + 8]), pos + 8
        elif wire_type == _LEN:
            size, pos = _read_varint(view, pos)
            value, pos = view[pos : pos + size], pos + size
        elif wire_type == _FIXED32:
            value, pos = bytes(view[pos : pos + 4]), pos + 4
        else:
            raise ValueError(f"field {field}: wire type {wire_type} is not supported")
        if pos > end:
            raise ValueError(f"field {field} runs past the end of the message")
        yield field, wire_type, value


def decode_logprob_response(data):
    """A LogProbAnswer from a serialized LogProbResponse; ValueError when the
    bytes are not one."""
    chunks = {name: [] for name in (*_FLOATS.values(), *_INT64S.values())}
    answer = LogProbAnswer()
    for field, wire_type, value in iter_fields(data):
        if field in _STRINGS and wire_type == _LEN:
            setattr(answer, _STRINGS[field], bytes(value).decode("utf-8"))
        elif field in _FLOATS and wire_type == _LEN:
            if len(value) % 4:
                raise ValueError(f"{_FLOATS[field]}: {len(value)} bytes, not whole floats")
            chunks[_FLOATS[field]].append(np.frombuffer(value, "<f4"))
        elif field in _FLOATS and wire_type == _FIXED32:
            chunks[_FLOATS[field]].append(np.frombuffer(value, "<f4"))
        elif field in _INT64S and wire_type == _LEN:
            chunks[_INT64S[field]].append(read_varints(value))
        elif field in _INT64S and wire_type == _VARINT:
            chunks[_INT64S[field]].append(np.array([_signed(value)], np.int64))
        elif field in _INTS and wire_type == _VARINT:
            setattr(answer, _INTS[field], _signed(value))
        elif field == 10 and wire_type == _LEN:
            answer.timing = decode_server_timing(value)
        else:
            if answer.unknown is None:
                answer.unknown = {}
            answer.unknown.setdefault(field, []).append(
                bytes(value) if isinstance(value, memoryview) else value
            )
    for name, parts in chunks.items():
        if parts:
            array = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if array.dtype.byteorder not in ("=", "|"):
                array = array.astype(array.dtype.newbyteorder("="))
            setattr(answer, name, array)
    return answer
