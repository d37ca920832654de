"""How one logprobs() call travels: cut into requests ("slices") that fit the
server's limits, sent side by side over several connections, and put back
together in order.

A slice is rows [start, stop) of the call; its request is written once from
the caller's memory (wire.encode_logprob_request), or names the rows in a
shared-memory region (shm.py). Each row's answer depends on that row alone,
so the merged result has the bits of one unsplit call.

TransferOptions holds the knobs; the defaults suit both a loopback server and
a remote one.
"""

import dataclasses
import re
import threading
import time

import numpy as np

from detlogp import tensors, wire
from detlogp.errors import DataLoss, InvalidArgument, MessageTooLarge
from detlogp.results import LogProbResult, check_sizes
from detlogp.v1 import detlogp_pb2 as pb

# Limits assumed for a server that does not report them in ModelInfo (the
# server's own defaults: --max_request_rows, --max_message_mb).
DEFAULT_MAX_REQUEST_ROWS = 65536
DEFAULT_MAX_MESSAGE_BYTES = 160 << 20
# Room left in each message for everything but the rows (ids, names, tags).
MESSAGE_HEADROOM_BYTES = 64 << 10
# Bytes a response spends per row beyond its values: a top-k id is a varint
# of up to ten bytes.
_TOP_K_ROW_BYTES = 4 + 10
# The largest top_k any server answers (the kernels' limit; --max_top_k is at
# most this): a larger one is refused whatever the slicing, so it does not
# shrink the slices.
_MAX_TOP_K_ANSWERED = 32

SHARED_MEMORY_MODES = ("auto", "off", "system", "cuda")
NATIVE_TRANSPORT_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """How the client moves a logprobs() call's rows.

    slice_bytes: hidden bytes per request sent over gRPC at most (the
      server parses smaller messages faster, and slices overlap on the
      connections).
    min_slice_bytes: a call's gRPC requests are cut smaller than
      slice_bytes, down to this, so that every connection carries one.
    system_slice_bytes: hidden bytes per request whose rows lie in a system
      region: small enough that copying the next slice in overlaps the
      server's work on the last.
    copy_threads: threads that copy one slice's host rows into a system
      region.
    cuda_slice_bytes: the same for a CUDA region (a device-to-device copy
      costs little; fewer, larger requests do).
    connections: connections per target a large call is spread over; 0:
      `auto_connections` for calls of `auto_connections_min_bytes` of rows
      or more (1,024 rows of H=4096 bf16), else 1.
    slices_in_flight_per_connection: requests of one call outstanding on
      each connection at once.
    shared_memory: "auto" (a CUDA region for a CUDA tensor, a system region
      for host rows, when the target is on this host: a Unix socket or a
      loopback address), "system" (host rows and CUDA tensors both through
      a system region), "cuda" (CUDA tensors only), or "off".
    region_slices: requests of one call whose rows a region holds at once
      (a region is this many system or CUDA slices).
    shared_memory_bytes: bytes of regions the client may hold per target and
      kind (system, each CUDA device); a call waits for slots within it.
    shared_memory_min_bytes: calls with fewer hidden bytes go over gRPC
      (as fast for them, and nothing is registered for a client that only
      makes small calls).
    native_transport: "auto" (a call of `auto_connections_min_bytes` of
      rows or more whose rows go in the messages is sent by the C++ client,
      detlogp/native.py, when its library is found), "on" (the same, and a
      missing library is an error), or "off" (grpcio only).
    """

    slice_bytes: int = 8 << 20
    min_slice_bytes: int = 1 << 20
    system_slice_bytes: int = 8 << 20
    copy_threads: int = 4
    cuda_slice_bytes: int = 64 << 20
    connections: int = 0
    auto_connections: int = 8
    auto_connections_min_bytes: int = 8 << 20
    slices_in_flight_per_connection: int = 2
    region_slices: int = 8
    shared_memory: str = "auto"
    shared_memory_bytes: int = 1 << 30
    shared_memory_min_bytes: int = 64 << 10
    native_transport: str = "auto"

    def validated(self):
        """self, or ValueError naming the first bad field."""
        for name in (
            "slice_bytes",
            "min_slice_bytes",
            "system_slice_bytes",
            "cuda_slice_bytes",
            "shared_memory_bytes",
            "auto_connections_min_bytes",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TransferOptions.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "auto_connections",
            "slices_in_flight_per_connection",
            "region_slices",
            "copy_threads",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TransferOptions.{name} must be >= 1, got {getattr(self, name)}")
        if int(self.shared_memory_min_bytes) < 0:
            raise ValueError(
                "TransferOptions.shared_memory_min_bytes must be >= 0, got "
                f"{self.shared_memory_min_bytes}"
            )
        if int(self.connections) < 0:
            raise ValueError(f"TransferOptions.connections must be >= 0, got {self.connections}")
        if self.native_transport not in NATIVE_TRANSPORT_MODES:
            raise ValueError(
                f"TransferOptions.native_transport must be one of {NATIVE_TRANSPORT_MODES}, "
                f"got {self.native_transport!r}"
            )
        if self.shared_memory not in SHARED_MEMORY_MODES:
            raise ValueError(
                f"TransferOptions.shared_memory must be one of {SHARED_MEMORY_MODES}, "
                f"got {self.shared_memory!r}"
            )
        return self

    def connections_for(self, hidden_bytes):
        if self.connections:
            return int(self.connections)
        return self.auto_connections if hidden_bytes >= self.auto_connections_min_bytes else 1

    def slice_bytes_for(self, kind, hidden_bytes):
        """Hidden bytes per request of a call of `hidden_bytes` whose rows
        lie in `kind` of region (None: in the message). gRPC requests are
        cut so that each connection has one: the call's bytes all move at
        once."""
        if kind is None:
            spread = -(-int(hidden_bytes) // self.connections_for(hidden_bytes))
            return min(self.slice_bytes, max(self.min_slice_bytes, spread))
        return self.cuda_slice_bytes if kind == "cuda" else self.system_slice_bytes


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one server accepts (ModelInfo.max_request_rows and
    .max_receive_message_bytes; its defaults when it does not say)."""

    max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @classmethod
    def from_model_info(cls, info):
        return cls(
            max_request_rows=int(getattr(info, "max_request_rows", 0)) or DEFAULT_MAX_REQUEST_ROWS,
            max_message_bytes=int(getattr(info, "max_receive_message_bytes", 0))
            or DEFAULT_MAX_MESSAGE_BYTES,
        )


@dataclasses.dataclass
class CallTimings:
    """Where a logprobs() call's time went, in seconds (timing=True).

    total_s: the call, from arguments to result.
    prepare_s: the rows in their wire form, once for the call (dtype view,
      a CUDA tensor's copy to the host when no CUDA region is used).
    build_s: writing requests: rows into messages, or into shared memory.
    transfer_s: the round trips less the server's time: sending and
      receiving the messages.
    validate_s, queue_s, compute_s: on the server (ServerTiming): parsing,
      checks and shared-memory reads; waiting for a batch; computing.
    return_s: reading the answers and assembling the result.
    With several slices, build_s .. return_s are sums over slices, which
    overlap on the connections: they can add up to more than total_s.
    slices, connections: requests sent (retries excluded) and connections
    used per target. path: "grpc", "system_shm" or "cuda_shm" (the path
    of the last slice sent; a refused region falls back to "grpc").
    native: the call was sent by the C++ client (native_transport): its
    time is transfer_s (less the server's part), slices its requests.
    """

    total_s: float = 0.0
    prepare_s: float = 0.0
    build_s: float = 0.0
    transfer_s: float = 0.0
    validate_s: float = 0.0
    queue_s: float = 0.0
    compute_s: float = 0.0
    return_s: float = 0.0
    slices: int = 0
    connections: int = 1
    path: str = "grpc"
    server_reported: bool = False
    native: bool = False
    # Slices finish on several threads at once.
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )

    def as_dict(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}

    def record_native(self, elapsed_s, answer):
        """The C++ client's call: `answer` (native._Answer) holds its
        requests, connections and summed ServerTiming."""
        with self._lock:
            self.native = True
            self.slices += int(answer.requests)
            self.connections = int(answer.connections)
            self.path = answer.path.decode() or "grpc"
            if not answer.server_reported_timing:
                self.transfer_s += elapsed_s
                return
            self.server_reported = True
            per_connection = answer.total_us * 1e-6 / max(int(answer.connections), 1)
            self.transfer_s += max(elapsed_s - per_connection, 0.0)
            self.validate_s += answer.validate_us * 1e-6
            self.queue_s += answer.queue_us * 1e-6
            self.compute_s += answer.compute_us * 1e-6

    def add_slice(self, build_s, round_trip_s, decode_s, server_timing, path):
        with self._lock:
            self._add_slice(build_s, round_trip_s, decode_s, server_timing, path)

    def _add_slice(self, build_s, round_trip_s, decode_s, server_timing, path):
        self.slices += 1
        self.build_s += build_s
        self.return_s += decode_s
        self.path = path
        if server_timing is None:
            self.transfer_s += round_trip_s
            return
        self.server_reported = True
        server_s = server_timing.total_us * 1e-6
        self.transfer_s += max(round_trip_s - server_s, 0.0)
        self.validate_s += server_timing.validate_us * 1e-6
        self.queue_s += server_timing.queue_us * 1e-6
        self.compute_s += server_timing.compute_us * 1e-6


@dataclasses.dataclass(frozen=True)
class Slice:
    index: int
    start: int
    stop: int

    @property
    def rows(self):
        return self.stop - self.start


def rows_limit_in(error):
    """The server's --max_request_rows as its refusal of a too-large request
    states it (reason ROWS_OVER_LIMIT, metadata "limit"), or None."""
    if getattr(error, "reason", None) != "ROWS_OVER_LIMIT":
        return None
    return error.limit


_ROW_FIELD = re.compile(r"^target_ids\[(\d+)\]")


class LogProbCall:
    """One logprobs() call, its inputs checked and kept in the form requests
    are written from: the hidden rows (a torch CUDA tensor stays on its GPU
    until a path needs it on the host), the target ids as int64, the other
    fields. Slices are cut by `slices(...)`."""

    def __init__(self, hidden, targets, fields):
        self.fields = fields
        self.target_ids = tensors.target_id_array(targets)
        # Slices copy their rows into regions one at a time (RowCopier).
        self.copy_lock = threading.Lock()
        self.cuda_tensor = None
        self.cuda_stream = None
        self._host = None
        self._host_lock = threading.Lock()
        if tensors.is_torch_tensor(hidden) and hidden.is_cuda:
            import torch  # a torch tensor was passed, so torch is installed

            if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
                raise TypeError(
                    f"hidden torch dtype {hidden.dtype} is not bfloat16, float16 or float32"
                )
            hidden = hidden.detach()
            if hidden.dtype == torch.float64:
                hidden = hidden.to(torch.float32)
            self.cuda_tensor = hidden
            # Rows are copied into CUDA regions on the caller's stream (the
            # one its tensor was written on), captured on the caller's thread.
            self.cuda_stream = torch.cuda.current_stream(hidden.device)
            self.dtype = _TORCH_WIRE_DTYPES[str(hidden.dtype)]
            self.shape = tuple(int(d) for d in hidden.shape)
            self.element_bytes = hidden.element_size()
        else:
            self.dtype, self._host = tensors.hidden_wire_array(hidden)
            self.shape = tuple(int(d) for d in self._host.shape)
            self.element_bytes = self._host.itemsize
        # Only a well-formed call is cut; any other goes whole, so the
        # server names what is wrong exactly as for one request.
        self.sliceable = len(self.shape) == 2 and self.shape[0] == len(self.target_ids)
        self.rows = self.shape[0] if self.sliceable else 0
        self.row_bytes = self.shape[1] * self.element_bytes if self.sliceable else 0

    @property
    def hidden_bytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * self.element_bytes

    def host_rows_cached(self):
        return self._host

    def host_rows(self):
        """The rows on the host in wire layout (a CUDA tensor is copied
        once, on first use, by the first slice that asks)."""
        with self._host_lock:
            if self._host is None:
                self._host = tensors.cuda_rows_to_host(self.cuda_tensor, self.cuda_stream)
        return self._host

    def slice_host_rows(self, piece, out=None):
        """Rows [piece.start, piece.stop) on the host in wire layout. A CUDA
        tensor's rows are copied alone, on the caller's stream: slices copy
        side by side and each goes out as soon as its own rows are here.
        `out`: a host array of their bytes to copy them into."""
        if self.cuda_tensor is None or self._host is not None:
            rows = self.host_rows()[piece.start : piece.stop]
            if out is None:
                return rows
            dest = out.view(rows.dtype).reshape(rows.shape)
            np.copyto(dest, rows)
            return dest
        return tensors.cuda_rows_to_host(
            self.cuda_tensor[piece.start : piece.stop], self.cuda_stream, out
        )

    def response_row_bytes(self):
        per_row = 4 * (1 + self.fields.return_lse + self.fields.return_entropy)
        return per_row + min(self.fields.top_k, _MAX_TOP_K_ANSWERED) * _TOP_K_ROW_BYTES

    def slices(self, limits, preferred_bytes, receive_limit_bytes):
        """The call cut into Slices: at most limits.max_request_rows rows,
        each request (with its rows in it, so that any slice can fall back
        from shared memory to gRPC bytes) and each answer below the message
        limits, about `preferred_bytes` of hidden rows each. MessageTooLarge
        when a single row cannot fit."""
        if not self.sliceable or self.rows == 0:
            return [Slice(0, 0, self.rows)]
        request_row = 10 + self.row_bytes
        room = limits.max_message_bytes - MESSAGE_HEADROOM_BYTES
        if request_row > room:
            raise MessageTooLarge(
                f"hidden: one row is {self.row_bytes} bytes; the server receives "
                f"messages of at most {limits.max_message_bytes} bytes "
                "(--max_message_mb)",
                size_bytes=request_row,
                limit_bytes=limits.max_message_bytes,
            )
        answer_room = min(receive_limit_bytes, limits.max_message_bytes) - MESSAGE_HEADROOM_BYTES
        rows = min(
            limits.max_request_rows,
            room // request_row,
            max(answer_room // self.response_row_bytes(), 1),
            max(int(preferred_bytes) // max(self.row_bytes, 1), 1),
        )
        count = -(-self.rows // rows)
        # Even slices: none left much smaller than the others.
        rows = -(-self.rows // count)
        return [
            Slice(i, i * rows, min((i + 1) * rows, self.rows))
            for i in range(count)
            if i * rows < self.rows
        ]

    def request_bytes(self, piece, version=None, ref=None):
        """The serialized request for `piece` (a Slice): rows in the message,
        or `ref` (a wire.RegionRef) to where they lie. `version` pins it."""
        fields = self.fields
        if version is not None:
            fields = dataclasses.replace(fields, model_version=int(version))
        if not self.sliceable:
            return wire.encode_logprob_request(
                fields, self.dtype, self.shape, self.target_ids, data=self.host_rows()
            )
        shape = (piece.rows, self.shape[1])
        ids = self.target_ids[piece.start : piece.stop]
        if ref is not None:
            return wire.encode_logprob_request(fields, self.dtype, shape, ids, ref=ref)
        rows = self.slice_host_rows(piece)
        return wire.encode_logprob_request(fields, self.dtype, shape, ids, data=rows)

    def slice_error(self, piece, error):
        """A slice's error with its row numbers made the call's: the server
        names target_ids[i] of the slice; the caller's row is start + i."""
        if piece.start == 0 or not isinstance(error, InvalidArgument):
            return error
        match = _ROW_FIELD.fullmatch(error.field or "")
        if not match:
            return error
        field = f"target_ids[{int(match.group(1)) + piece.start}]"
        said = dataclasses.replace(error.status_details, fields=[field])
        details = error.details.replace(error.field, field, 1)
        return type(error)(details, error.code, status_details=said)


_TORCH_WIRE_DTYPES = {
    "torch.bfloat16": pb.DTYPE_BFLOAT16,
    "torch.float16": pb.DTYPE_FLOAT16,
    "torch.float32": pb.DTYPE_FLOAT32,
}


def merge_answers(call, pieces, answers, timings=None):
    """One LogProbResult from the answers to `pieces`, in order. Each answer
    is checked against its slice's sizes (DataLoss naming the field); the
    slices must agree on model, version and determinism key."""
    started = time.perf_counter()
    first = answers[0]
    for piece, answer in zip(pieces, answers):
        check_sizes(
            answer,
            piece.rows,
            call.fields.return_lse,
            call.fields.return_entropy,
            call.fields.top_k,
        )
        for name in ("model", "model_version", "determinism_key"):
            if getattr(answer, name) != getattr(first, name):
                raise DataLoss(
                    f"{name}: the slices of one call were answered with different "
                    f"values ({getattr(first, name)!r}, then {getattr(answer, name)!r} "
                    f"for rows {piece.start}..{piece.stop})"
                )
    k = int(call.fields.top_k)

    def joined(name, dtype):
        parts = [getattr(a, name) for a in answers]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)

    logprobs = joined("logprobs", np.float32)
    lse = joined("lse", np.float32) if call.fields.return_lse else None
    entropy = joined("entropy", np.float32) if call.fields.return_entropy else None
    top_ids = top_logprobs = None
    if k:
        top_ids = joined("top_ids", np.int64).reshape(-1, k)
        top_logprobs = joined("top_logprobs", np.float32).reshape(-1, k)
    result = LogProbResult(
        logprobs=logprobs,
        lse=lse,
        determinism_key=first.determinism_key,
        request_id=first.request_id,
        model=first.model,
        model_version=int(first.model_version),
        entropy=entropy,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        path="+".join(sorted({answer.path for answer in answers})),
    )
    if timings is not None:
        timings.return_s += time.perf_counter() - started
        result.timings = timings
    return result


def versions_to_repeat(answers):
    """The slices answered on another version than the first slice (a new
    version was published, or replicas differ, while the call ran): they
    are sent again pinned to the first slice's version."""
    version = answers[0].model_version
    return [i for i, a in enumerate(answers) if a.model_version != version]
