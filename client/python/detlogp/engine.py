"""The C++ large-call engine (client/capi/detlogp_client.h), loaded with
ctypes.

Every call larger than one request goes through it: it cuts the call to
the server's limits, spreads it over connections, puts its rows in its own
system or CUDA shared-memory regions when the server is on this host,
keeps its outstanding rows within the server's queue, resends refused
requests after the server's pushback, pins the call to one model version
and joins the answers in order. ctypes releases the GIL for the call. A
blocking call (`Engine.score`) serves the sync client; the asyncio client
awaits `Engine.score_async`, resolved from the engine's own thread through
`loop.call_soon_threadsafe` (no executor thread per call).

The library is found at $DETLOGP_CLIENT_LIBRARY, in the installed package
(detlogp/_lib/, built by `pip install ./client/python` where gRPC's C++
libraries are installed, or vendored in the wheel of tools/build_wheel.sh),
or as bazel-bin/client/capi/libdetlogp_client.so in the working directory or
a folder above it (`bazel build //client/capi:libdetlogp_client.so`).
"""

import ctypes
import dataclasses
import itertools
import os
import pathlib
import sys
import threading
import time
from typing import Optional

import numpy as np

from detlogp import errors
from detlogp.libraries import find_library_file
from detlogp.results import LogProbResult

__all__ = ["find_library", "load_library", "Engine", "EngineSettings"]

LIBRARY_ENV = "DETLOGP_CLIENT_LIBRARY"
ABI_VERSION = 6
_LIBRARY_PATH = pathlib.Path("bazel-bin") / "client" / "capi" / "libdetlogp_client.so"
_ERROR_BYTES = 4096
# No deadline: a year (the C++ client always sets one).
_NO_DEADLINE_S = 365 * 86400.0
_FAILED_PRECONDITION = 9  # grpc.StatusCode.FAILED_PRECONDITION
# grpcio-tools' protoc carries a protobuf whose symbols the C++ client's
# protobuf would bind to when loaded beside it (an abort, or a crash later).
_CLASHING_MODULE = "grpc_tools._protoc_compiler"

_lock = threading.Lock()
_loaded = {}  # path -> CDLL


class _ChannelArg(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_char_p),
        ("int_value", ctypes.c_int64),
        ("string_value", ctypes.c_char_p),
    ]


class _Options(ctypes.Structure):
    _fields_ = [
        ("targets", ctypes.POINTER(ctypes.c_char_p)),
        ("target_count", ctypes.c_int),
        ("timeout_s", ctypes.c_double),
        ("max_message_bytes", ctypes.c_int64),
        ("connections", ctypes.c_int),
        ("spread_request_bytes", ctypes.c_int64),
        ("spread_requests_in_flight", ctypes.c_int),
        ("system_shared_memory", ctypes.c_int),
        ("cuda_shared_memory", ctypes.c_int),
        ("channel_args", ctypes.POINTER(_ChannelArg)),
        ("channel_arg_count", ctypes.c_int),
        ("async_threads", ctypes.c_int),
        ("bearer_token", ctypes.c_char_p),
        ("tls_root_certs", ctypes.c_char_p),
        ("tls_client_cert", ctypes.c_char_p),
        ("tls_client_key", ctypes.c_char_p),
        ("region_piece_bytes", ctypes.c_int64),
    ]


class _Request(ctypes.Structure):
    _fields_ = [
        ("request_id", ctypes.c_char_p),
        ("dtype", ctypes.c_int),
        ("rows", ctypes.c_int64),
        ("hidden_size", ctypes.c_int64),
        ("hidden", ctypes.c_void_p),
        ("device", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("target_ids", ctypes.c_void_p),
        ("temperature", ctypes.c_float),
        ("return_lse", ctypes.c_int),
        ("return_entropy", ctypes.c_int),
        ("return_timing", ctypes.c_int),
        ("top_k", ctypes.c_int64),
        ("model", ctypes.c_char_p),
        ("model_version", ctypes.c_int64),
        ("timeout_s", ctypes.c_double),
    ]


class _Answer(ctypes.Structure):
    _fields_ = [
        ("logprobs", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("entropy", ctypes.c_void_p),
        ("top_ids", ctypes.c_void_p),
        ("top_logprobs", ctypes.c_void_p),
        ("model_version", ctypes.c_int64),
        ("requests", ctypes.c_int64),
        ("connections", ctypes.c_int32),
        ("server_reported_timing", ctypes.c_int32),
        ("validate_us", ctypes.c_int64),
        ("queue_us", ctypes.c_int64),
        ("compute_us", ctypes.c_int64),
        ("total_us", ctypes.c_int64),
        ("model", ctypes.c_char * 256),
        ("determinism_key", ctypes.c_char * 128),
        ("path", ctypes.c_char * 16),
        ("path_refused", ctypes.c_char * 16),
        ("queue_full_retries", ctypes.c_int64),
        ("error_details_len", ctypes.c_int64),
        ("error_details", ctypes.c_ubyte * 4096),
    ]


_DONE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)


def find_library(start=None):
    """$DETLOGP_CLIENT_LIBRARY, else detlogp/_lib/libdetlogp_client.so in
    the installed package, else bazel-bin/client/capi/libdetlogp_client.so
    in `start` (or the working directory) or a folder above it; None if not
    found."""
    return find_library_file(LIBRARY_ENV, _LIBRARY_PATH, start)


def load_library():
    """The loaded library (once per path); RuntimeError saying what is
    missing when it cannot be found, loaded, or is of another ABI."""
    path = find_library()
    if path is None:
        raise RuntimeError(
            f"libdetlogp_client.so not found: `pip install ./client/python` builds it "
            "where gRPC's C++ libraries are installed, tools/build_wheel.sh makes a "
            f"wheel that brings them, or set ${LIBRARY_ENV}"
        )
    if _CLASHING_MODULE in sys.modules:
        raise RuntimeError(
            f"{_CLASHING_MODULE} is loaded in this process: its own protobuf "
            "would clash with the C++ client's"
        )
    with _lock:
        if path in _loaded:
            return _loaded[path]
        try:
            # Its own gRPC, protobuf and Abseil first: a process may hold
            # other copies of them (grpcio's tools bundle protobuf's).
            lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_DEEPBIND)
        except OSError as error:
            raise RuntimeError(f"cannot load {path}: {error}") from None
        if lib.detlogp_client_abi_version() != ABI_VERSION:
            raise RuntimeError(
                f"{path} has ABI {lib.detlogp_client_abi_version()}, this "
                f"client needs {ABI_VERSION}"
            )
        _declare(lib)
        _loaded[path] = lib
        return lib


def _declare(lib):
    error = [ctypes.c_char_p, ctypes.c_size_t]
    lib.detlogp_client_create.argtypes = [
        ctypes.POINTER(_Options),
        ctypes.POINTER(ctypes.c_void_p),
        *error,
    ]
    call = [ctypes.c_void_p, ctypes.POINTER(_Request), ctypes.POINTER(_Answer)]
    lib.detlogp_client_score.argtypes = [*call, *error]
    lib.detlogp_client_score_async.argtypes = [*call, _DONE, ctypes.c_void_p, *error]
    lib.detlogp_client_shared_memory_refusal.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.detlogp_client_shared_memory_refusal.restype = None
    lib.detlogp_client_destroy.argtypes = [ctypes.c_void_p]
    lib.detlogp_client_destroy.restype = None


def _text(value):
    if value is None:
        return None
    return value if isinstance(value, bytes) else str(value).encode()


def _pointer(array):
    return None if array is None else array.ctypes.data


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an Engine is made with (DetlogpClientOptions)."""

    # The servers: replicas of one model; the first also takes the rows in
    # the engine's regions.
    targets: tuple = ()
    # Seconds per call (None: no deadline).
    timeout: Optional[float] = None
    # Answers received at most.
    max_message_bytes: int = 256 << 20
    # How a call is spread: connections (0: automatic), hidden bytes per
    # request at most, requests outstanding per connection.
    connections: int = 0
    request_bytes: int = 8 << 20
    requests_in_flight: int = 2
    # Hidden bytes per piece, at least, of a call written into the system
    # region; 0: the engine's own default.
    region_piece_bytes: int = 0
    # Whether the engine may put rows in its system and CUDA regions.
    system_shared_memory: bool = False
    cuda_shared_memory: bool = False
    # (key, value) pairs by gRPC's name.
    channel_args: tuple = ()
    # token, root_certificates, client_certificate, client_key.
    security: dict = dataclasses.field(default_factory=dict)


class EngineUnusable(RuntimeError):
    """The library cannot make a client in this process (a child forked
    from a process whose gRPC threads it had started)."""


class Engine:
    """One C++ client, its connections and regions kept between calls.
    ValueError naming the field when the library refuses a setting (an
    unknown channel argument, a bad target); EngineUnusable when it can make
    no client here."""

    def __init__(self, lib, settings):
        self._lib = lib
        targets = [_text(t) for t in settings.targets]
        args = [_channel_arg(key, value) for key, value in settings.channel_args]
        security = settings.security
        self._keep = (
            (ctypes.c_char_p * len(targets))(*targets),
            (_ChannelArg * max(len(args), 1))(*args),
        )
        options = _Options(
            targets=self._keep[0],
            target_count=len(targets),
            timeout_s=_NO_DEADLINE_S if settings.timeout is None else float(settings.timeout),
            max_message_bytes=int(settings.max_message_bytes),
            connections=int(settings.connections),
            spread_request_bytes=int(settings.request_bytes),
            spread_requests_in_flight=int(settings.requests_in_flight),
            system_shared_memory=int(bool(settings.system_shared_memory)),
            cuda_shared_memory=int(bool(settings.cuda_shared_memory)),
            channel_args=self._keep[1],
            channel_arg_count=len(args),
            async_threads=0,
            bearer_token=_text(security.get("token")),
            tls_root_certs=_text(security.get("root_certificates")),
            tls_client_cert=_text(security.get("client_certificate")),
            tls_client_key=_text(security.get("client_key")),
            region_piece_bytes=int(settings.region_piece_bytes),
        )
        handle = ctypes.c_void_p()
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        code = lib.detlogp_client_create(
            ctypes.byref(options), ctypes.byref(handle), error, _ERROR_BYTES
        )
        if code == _FAILED_PRECONDITION:
            raise EngineUnusable(f"the C++ engine: {error.value.decode(errors='replace')}")
        if code != 0:
            raise ValueError(f"the C++ engine: {error.value.decode(errors='replace')}")
        self._handle = handle
        # Asynchronous calls in flight by number, each with what it needs
        # kept alive until the engine calls back.
        self._pending = {}
        self._pending_lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._done = _DONE(self._on_done)

    def close(self):
        """Waits for asynchronous calls in flight, then frees the C++
        client (its regions unregistered, its connections closed)."""
        handle, self._handle = self._handle, None
        if handle:
            self._lib.detlogp_client_destroy(handle)

    def shared_memory_refusal(self):
        """Why a region of the engine's is not used ("" when none was
        refused)."""
        text = ctypes.create_string_buffer(_ERROR_BYTES)
        self._lib.detlogp_client_shared_memory_refusal(self._handle, text, _ERROR_BYTES)
        return text.value.decode(errors="replace")

    def score(self, call, timings=None, timeout=None):
        """The LogProbResult of `call` (a calls.LogProbCall); its failure
        raised as the DetlogpError of its status and details. `timeout`:
        seconds (None: the engine's)."""
        prepared = _Prepared(call, timeout)
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        started = time.perf_counter()
        code = self._lib.detlogp_client_score(
            self._handle,
            ctypes.byref(prepared.request),
            ctypes.byref(prepared.answer),
            error,
            _ERROR_BYTES,
        )
        return prepared.outcome(code, error.value, time.perf_counter() - started, timings)

    def score_async(self, call, loop, timings=None, timeout=None):
        """An asyncio future of `loop` resolved with score()'s outcome. The
        call keeps running when the future is cancelled (its arrays are
        kept until the engine is done with them)."""
        prepared = _Prepared(call, timeout)
        future = loop.create_future()
        number = next(self._numbers)
        with self._pending_lock:
            self._pending[number] = (loop, future, prepared, timings, time.perf_counter())
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        code = self._lib.detlogp_client_score_async(
            self._handle,
            ctypes.byref(prepared.request),
            ctypes.byref(prepared.answer),
            self._done,
            ctypes.c_void_p(number),
            error,
            _ERROR_BYTES,
        )
        if code != 0:
            with self._pending_lock:
                del self._pending[number]
            prepared.outcome(code, error.value, 0.0, None)  # raises
        return future

    def _on_done(self, number, code, message):
        """On an engine thread: hands the outcome to the call's loop."""
        with self._pending_lock:
            loop, future, prepared, timings, started = self._pending.pop(number)
        elapsed = time.perf_counter() - started
        try:
            loop.call_soon_threadsafe(
                _settle, future, prepared, code, message or b"", elapsed, timings
            )
        except RuntimeError:
            pass  # the loop is closed: nobody awaits the answer


def _settle(future, prepared, code, message, elapsed, timings):
    if future.cancelled():
        return
    try:
        future.set_result(prepared.outcome(code, message, elapsed, timings))
    except errors.DetlogpError as error:
        future.set_exception(error)


def _channel_arg(key, value):
    if isinstance(value, (str, bytes)):
        return _ChannelArg(key=_text(key), int_value=0, string_value=_text(value))
    return _ChannelArg(key=_text(key), int_value=int(value), string_value=None)


class _Prepared:
    """One call's request and answer structures and the arrays they point
    to, kept together for as long as the engine may use them."""

    def __init__(self, call, timeout):
        self.call = call
        fields = call.fields
        n = call.rows
        k = int(fields.top_k)
        if call.engine_reads_device_rows():
            tensor = call.cuda_tensor
            rows, device, stream = tensor.data_ptr(), tensor.device.index, call.cuda_stream
            stream = stream.cuda_stream
        else:
            rows, device, stream = _pointer(call.host_rows()), -1, None
        self.ids = np.ascontiguousarray(call.target_ids, dtype=np.int64)
        self.logprobs = np.empty(n, np.float32)
        self.lse = np.empty(n, np.float32) if fields.return_lse else None
        self.entropy = np.empty(n, np.float32) if fields.return_entropy else None
        self.top_ids = np.empty((n, k), np.int64) if k else None
        self.top_logprobs = np.empty((n, k), np.float32) if k else None
        self.request = _Request(
            request_id=_text(fields.request_id),
            dtype=int(call.dtype),
            rows=n,
            hidden_size=int(call.shape[1]),
            hidden=rows,
            device=device,
            stream=stream,
            target_ids=_pointer(self.ids),
            temperature=float(fields.temperature),
            return_lse=int(fields.return_lse),
            return_entropy=int(fields.return_entropy),
            return_timing=int(fields.return_timing),
            top_k=k,
            model=_text(fields.model),
            model_version=int(fields.model_version),
            timeout_s=float(timeout) if timeout is not None else 0.0,
        )
        self.answer = _Answer(
            logprobs=_pointer(self.logprobs),
            lse=_pointer(self.lse),
            entropy=_pointer(self.entropy),
            top_ids=_pointer(self.top_ids),
            top_logprobs=_pointer(self.top_logprobs),
        )

    def outcome(self, code, message, elapsed, timings):
        """The LogProbResult, or the call's error raised."""
        answer = self.answer
        if code != 0:
            details = bytes(answer.error_details[: answer.error_details_len]) or None
            raise errors.from_status(code, message.decode(errors="replace"), details)
        if timings is not None:
            timings.record_engine(elapsed, answer)
        return LogProbResult(
            logprobs=self.logprobs,
            lse=self.lse,
            determinism_key=answer.determinism_key.decode(),
            request_id=self.call.fields.request_id,
            model=answer.model.decode(),
            model_version=int(answer.model_version),
            entropy=self.entropy,
            top_ids=self.top_ids,
            top_logprobs=self.top_logprobs,
            timings=timings,
            path=answer.path.decode() or "grpc",
            path_refused=answer.path_refused.decode(),
            engine="native",
        )
