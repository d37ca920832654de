"""How a logprobs() call is sent, decided once for the sync and asyncio
clients: as one request through grpcio, or through the C++ engine
(engine.py), which owns every policy for larger calls.

A call goes through the engine when it does not fit one request of the
server's (rows, message size, answer size), when it is large enough that
spreading it over connections helps (TransferOptions.engine_min_bytes), or
when its rows can go through a shared-memory region (a server on this host,
TransferOptions.shared_memory_min_bytes). A smaller call is one request,
written by wire.py. The path is chosen before anything is sent and never
changes because of a server's answer. Without the engine's library, a call
that fits one request still works; a larger one raises EngineRequired.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import threading
import time

import numpy as np

from detlogp import tensors, wire
from detlogp.errors import DataLoss
from detlogp.results import LogProbResult, check_sizes
from detlogp.v1 import detlogp_pb2 as pb

# Limits assumed for a server that does not report them in ModelInfo: the
# default --max_request_rows, and messages well below the default
# --max_message_mb (640 MiB), which a server may have lowered.
DEFAULT_MAX_REQUEST_ROWS = 65536
DEFAULT_MAX_MESSAGE_BYTES = 160 << 20
# Room left in each message for everything but the rows (ids, names, tags).
MESSAGE_HEADROOM_BYTES = 64 << 10
# Bytes an answer spends per row beyond its floats: a top-k id is a varint
# of up to ten bytes; no server answers more than 32 of them.
_TOP_K_ROW_BYTES = 4 + 10
_MAX_TOP_K_ANSWERED = 32

SHARED_MEMORY_MODES = ("auto", "off", "system", "cuda")
NATIVE_TRANSPORT_MODES = ("auto", "on", "off")
GRPCIO, ENGINE = "grpcio", "engine"


class EngineRequired(RuntimeError):
    """A call larger than one request, and no C++ engine to send it."""


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """How the client sends a logprobs() call.

    engine_min_bytes: calls with this many hidden bytes or more go through
      the C++ engine (spread over connections), as does every call beyond
      one request's limits.
    connections: connections per target the engine spreads a call's rows
      over when they go in the messages; 0: 8 for calls of 8 MiB or more,
      else 1.
    slice_bytes: hidden bytes per request of a spread call at most.
    slices_in_flight_per_connection: requests of one call outstanding on
      each connection at once.
    region_piece_bytes: hidden bytes per piece, at least, of a call the
      engine writes into its system region (at most 8 pieces, each written
      just before its request is sent, so the server starts on the first
      while the rest are written); None: the engine's own
      (LogpClient::Options::region_piece_bytes).
    shared_memory: "auto" (a server on this host, a Unix socket or a
      loopback address, gets the rows through the engine's shared memory: a
      CUDA region for a bf16 CUDA tensor, a system region for host rows),
      "system" (host rows and CUDA tensors both through a system region),
      "cuda" (CUDA tensors only), or "off".
    shared_memory_min_bytes: calls with fewer hidden bytes go as one gRPC
      request (as fast for them, and nothing is registered for a client
      that only makes small calls).
    native_transport: "auto" (the engine when its library is found),
      "on" (the same, and a missing library fails the client's creation),
      or "off" (grpcio only: calls beyond one request raise EngineRequired).
    """

    engine_min_bytes: int = 1 << 20
    connections: int = 0
    slice_bytes: int = 8 << 20
    slices_in_flight_per_connection: int = 2
    region_piece_bytes: int | None = None
    shared_memory: str = "auto"
    shared_memory_min_bytes: int = 64 << 10
    native_transport: str = "auto"

    def validated(self):
        """self, or ValueError naming the first bad field."""
        for name in (
            "engine_min_bytes",
            "slice_bytes",
            "slices_in_flight_per_connection",
            "region_piece_bytes",
        ):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise ValueError(f"TransferOptions.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connections", "shared_memory_min_bytes"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"TransferOptions.{name} must be >= 0, got {getattr(self, name)}")
        for name, modes in (
            ("shared_memory", SHARED_MEMORY_MODES),
            ("native_transport", NATIVE_TRANSPORT_MODES),
        ):
            if getattr(self, name) not in modes:
                raise ValueError(
                    f"TransferOptions.{name} must be one of {modes}, got {getattr(self, name)!r}"
                )
        return self

    def regions_for(self, target):
        """(system, cuda): whether the engine may use each kind of region
        for `target`."""
        mode = self.shared_memory
        if mode == "auto":
            local = is_same_host(target)
            return local, local
        return mode == "system", mode == "cuda"


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

    @staticmethod
    def tightest(known):
        """The smallest of each limit over `known` (None: a server that did
        not say, taken to have the defaults)."""
        known = [k or ServerLimits() for k in known]
        return ServerLimits(
            min(k.max_request_rows for k in known), min(k.max_message_bytes for k in known)
        )


@dataclasses.dataclass
class CallTimings:
    """Where a logprobs() call's time went, in seconds (timing=True).

    total_s: the call, from arguments to result.
    prepare_s: the rows in their wire form (dtype view).
    build_s: writing the request (one request through grpcio).
    transfer_s: the round trips less the server's time.
    validate_s, queue_s, compute_s: on the server (ServerTiming), summed
      over the call's requests.
    return_s: reading the answer.
    slices, connections: requests sent and connections used. path: "grpc",
    "system_shm" or "cuda_shm". native: the C++ engine sent the call.
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

    def as_dict(self):
        return dataclasses.asdict(self)

    def record_engine(self, elapsed_s, answer):
        """The engine's call: `answer` (engine._Answer) holds its requests,
        connections, path and summed ServerTiming."""
        self.native = True
        self.slices += int(answer.requests)
        self.connections = int(answer.connections)
        self.path = answer.path.decode() or "grpc"
        server_s = 0.0
        if answer.server_reported_timing:
            server_s = answer.total_us * 1e-6 / max(int(answer.connections), 1)
            self._add_server(answer)
        self.transfer_s += max(elapsed_s - server_s, 0.0)

    def record_request(self, build_s, round_trip_s, return_s, server_timing):
        """One request sent through grpcio."""
        self.slices += 1
        self.build_s += build_s
        self.return_s += return_s
        server_s = 0.0
        if server_timing is not None:
            server_s = server_timing.total_us * 1e-6
            self._add_server(server_timing)
        self.transfer_s += max(round_trip_s - server_s, 0.0)

    def _add_server(self, timing):
        self.server_reported = True
        self.validate_s += timing.validate_us * 1e-6
        self.queue_s += timing.queue_us * 1e-6
        self.compute_s += timing.compute_us * 1e-6


_TORCH_WIRE_DTYPES = {
    "torch.bfloat16": pb.DTYPE_BFLOAT16,
    "torch.float16": pb.DTYPE_FLOAT16,
    "torch.float32": pb.DTYPE_FLOAT32,
}


class LogProbCall:
    """One logprobs() call, its inputs checked and kept in the form they are
    sent from: the hidden rows (a torch CUDA tensor stays on its GPU unless
    a path needs it on the host), the target ids as int64, the other
    fields (wire.RequestFields)."""

    def __init__(self, hidden, targets, fields):
        self.fields = fields
        self.target_ids = tensors.target_id_array(targets)
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
            # The engine copies the rows on the caller's stream (the one its
            # tensor was written on), captured on the caller's thread.
            self.cuda_stream = torch.cuda.current_stream(hidden.device)
            self.dtype = _TORCH_WIRE_DTYPES[str(hidden.dtype)]
            self.shape = tuple(int(d) for d in hidden.shape)
            self.element_bytes = hidden.element_size()
        else:
            self.dtype, self._host = tensors.hidden_wire_array(hidden)
            self.shape = tuple(int(d) for d in self._host.shape)
            self.element_bytes = self._host.itemsize
        # Only a well-formed call goes to the engine; any other goes whole,
        # so that the server names what is wrong.
        self.well_formed = len(self.shape) == 2 and self.shape[0] == len(self.target_ids)
        self.rows = self.shape[0] if self.well_formed else 0
        self.row_bytes = self.shape[1] * self.element_bytes if self.well_formed else 0

    @property
    def hidden_bytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * self.element_bytes

    def engine_reads_device_rows(self):
        """Whether the engine reads the rows where they lie on the GPU (a
        contiguous CUDA tensor; else they are copied to the host first)."""
        return self.cuda_tensor is not None and self.cuda_tensor.is_contiguous()

    def host_rows(self):
        """The rows on the host in wire layout (a CUDA tensor is copied
        once, on first use)."""
        with self._host_lock:
            if self._host is None:
                self._host = tensors.cuda_rows_to_host(self.cuda_tensor, self.cuda_stream)
        return self._host

    def fits_one_request(self, limits, receive_limit_bytes):
        """Whether the call is one request within `limits` whose answer is
        within `receive_limit_bytes`."""
        if not self.well_formed:
            return True  # the server says what is wrong with it
        room = limits.max_message_bytes - MESSAGE_HEADROOM_BYTES
        answer_room = min(receive_limit_bytes, limits.max_message_bytes) - MESSAGE_HEADROOM_BYTES
        fields = self.fields
        answer_row = (
            4 * (1 + fields.return_lse + fields.return_entropy)
            + min(fields.top_k, _MAX_TOP_K_ANSWERED) * _TOP_K_ROW_BYTES
        )
        return (
            self.rows <= limits.max_request_rows
            and self.rows * (10 + self.row_bytes) <= room
            and self.rows * answer_row <= answer_room
        )

    def request_bytes(self):
        """The serialized request of the whole call (rows in the message)."""
        return wire.encode_logprob_request(
            self.fields, self.dtype, self.shape, self.target_ids, data=self.host_rows()
        )

    def result_of(self, data, timings=None):
        """(LogProbResult, its ServerTiming or None) of the serialized answer
        to request_bytes(), checked against the call's sizes (DataLoss
        naming the field)."""
        try:
            answer = wire.decode_logprob_response(data)
        except ValueError as bad:
            raise DataLoss(f"LogProbResponse: {bad}") from None
        fields = self.fields
        rows = self.rows if self.well_formed else len(self.target_ids)
        check_sizes(answer, rows, fields.return_lse, fields.return_entropy, fields.top_k)
        k = int(fields.top_k)
        result = LogProbResult(
            logprobs=answer.logprobs.astype(np.float32, copy=False),
            lse=answer.lse if fields.return_lse else None,
            determinism_key=answer.determinism_key,
            request_id=answer.request_id,
            model=answer.model,
            model_version=int(answer.model_version),
            entropy=answer.entropy if fields.return_entropy else None,
            top_ids=answer.top_ids.reshape(-1, k) if k else None,
            top_logprobs=answer.top_logprobs.reshape(-1, k) if k else None,
            timings=timings,
        )
        return result, answer.timing


def choose_route(call, limits, options, receive_limit_bytes, engine_ready, target):
    """GRPCIO or ENGINE for `call` (see the module docstring);
    EngineRequired when only the engine can send it and there is none."""
    if not call.well_formed or call.rows == 0:
        return GRPCIO
    fits = call.fits_one_request(limits, receive_limit_bytes)
    system, cuda = options.regions_for(target)
    through_region = system or (cuda and call.cuda_tensor is not None)
    wants_engine = (
        not fits
        or call.hidden_bytes >= options.engine_min_bytes
        or (through_region and call.hidden_bytes >= options.shared_memory_min_bytes)
    )
    if wants_engine and engine_ready:
        return ENGINE
    if fits:
        return GRPCIO
    raise EngineRequired(
        f"a call of {call.rows} rows ({call.hidden_bytes} bytes) is larger than one request "
        f"of the server's ({limits.max_request_rows} rows, {limits.max_message_bytes} bytes): "
        "it needs the C++ engine, libdetlogp_client.so (`pip install ./client/python` builds "
        "it where gRPC's C++ libraries are installed; tools/build_wheel.sh makes a wheel that "
        "brings them)"
    )


class TimedRequest:
    """The times of one request sent through grpcio, kept in `timings`
    (None: not kept)."""

    def __init__(self, call, timings):
        self.call, self.timings = call, timings
        self.started = time.perf_counter()
        self.payload = call.request_bytes()
        self.sent = time.perf_counter()

    def result(self, data):
        answered = time.perf_counter()
        result, server_timing = self.call.result_of(data, self.timings)
        if self.timings is not None:
            self.timings.record_request(
                self.sent - self.started,
                answered - self.sent,
                time.perf_counter() - answered,
                server_timing,
            )
        return result


def is_same_host(target):
    """True when `target` reaches a server on this host: a Unix socket, or a
    loopback address or localhost (with or without a port, dns:/// or
    ipv4:/ipv6: scheme)."""
    target = target.strip()
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    addresses = target.split(",")
    return bool(addresses) and all(_is_loopback(_host_of(a)) for a in addresses)


def _host_of(address):
    if address.startswith("["):
        return address[1 : address.find("]")]
    if address.count(":") == 1:
        return address.rsplit(":", 1)[0]
    return address  # bare host, or an IPv6 address without a port


def _is_loopback(host):
    if host in ("localhost", "localhost6", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
