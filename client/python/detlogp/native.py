"""Large calls through the C++ client (client/capi/detlogp_client.h).

grpcio copies every request into its own buffer while holding the GIL, so
one Python process sending a large call over gRPC stays well below what a
server receives. When the C ABI library libdetlogp_client.so is found,
logprobs() hands such a call's rows to it instead (one ctypes call, the GIL
released): the C++ client cuts the call, spreads it over connections it
keeps, writes each request's rows once and checks every answer. The answer
carries the same bits, and its failure is the call's: the C++ client sends
requests refused for a full queue again itself, and its error comes with
the server's details. Only a failure of its own (a CUDA runtime that does
not load) hands the call back to the Python client.

The library is found at $DETLOGP_CLIENT_LIBRARY, in the installed package
(detlogp/_lib/), or as bazel-bin/client/capi/libdetlogp_client.so in the
working directory or a folder above it (`bazel build
//client/capi:libdetlogp_client.so`).
"""

import ctypes
import os
import pathlib
import sys
import threading
import time

import numpy as np

from detlogp import errors
from detlogp.libraries import find_library_file
from detlogp.results import LogProbResult

__all__ = ["find_library", "load_library", "takes_device_rows", "NativeClient", "NativeCallFailed"]

LIBRARY_ENV = "DETLOGP_CLIENT_LIBRARY"
ABI_VERSION = 4
_LIBRARY_PATH = pathlib.Path("bazel-bin") / "client" / "capi" / "libdetlogp_client.so"
_ERROR_BYTES = 4096
# grpcio-tools' protoc carries a protobuf whose symbols the C++ client's
# protobuf would bind to when loaded beside it (an abort, or a crash later).
_CLASHING_MODULE = "grpc_tools._protoc_compiler"

_lock = threading.Lock()
_loaded = {}  # path -> CDLL


class NativeCallFailed(Exception):
    """The C++ client's call failed: `code` (a gRPC status number),
    `message`, and `details`, the serialized google.rpc.Status when the
    status carried details (every status a server sends), else None (a
    failure of the client's own, such as a CUDA runtime that does not
    load). `error()` is the exception the caller raises."""

    def __init__(self, code, message, details=None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.details = code, message, details

    def error(self):
        return errors.from_status(self.code, self.message, self.details)


class _Options(ctypes.Structure):
    _fields_ = [
        ("target", ctypes.c_char_p),
        ("timeout_s", ctypes.c_double),
        ("max_message_bytes", ctypes.c_int64),
        ("connections", ctypes.c_int),
        ("spread_request_bytes", ctypes.c_int64),
        ("spread_requests_in_flight", ctypes.c_int),
        ("cuda_shared_memory", ctypes.c_int),
        ("bearer_token", ctypes.c_char_p),
        ("tls_root_certs", ctypes.c_char_p),
        ("tls_client_cert", ctypes.c_char_p),
        ("tls_client_key", ctypes.c_char_p),
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
        ("queue_full_retries", ctypes.c_int64),
        ("error_details_len", ctypes.c_int64),
        ("error_details", ctypes.c_ubyte * 4096),
    ]


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
            f"libdetlogp_client.so not found (set ${LIBRARY_ENV}, or build "
            "//client/capi:libdetlogp_client.so and work inside the repository)"
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
        lib.detlogp_client_create.argtypes = [
            ctypes.POINTER(_Options),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.detlogp_client_score.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(_Request),
            ctypes.POINTER(_Answer),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.detlogp_client_shared_memory_refusal.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.detlogp_client_shared_memory_refusal.restype = None
        lib.detlogp_client_destroy.argtypes = [ctypes.c_void_p]
        lib.detlogp_client_destroy.restype = None
        _loaded[path] = lib
        return lib


def _text(value):
    if value is None:
        return None
    return value if isinstance(value, bytes) else str(value).encode()


def _pointer(array):
    return None if array is None else array.ctypes.data


def takes_device_rows(call):
    """Whether `call`'s rows can be given to the C++ client where they lie:
    a contiguous bf16 CUDA tensor (what CUDA regions hold)."""
    tensor = call.cuda_tensor
    return tensor is not None and str(tensor.dtype) == "torch.bfloat16" and tensor.is_contiguous()


class NativeClient:
    """A C++ LogpClient for one target, its connections kept between calls.
    `transfer`: the TransferOptions whose connections, slice_bytes and
    slices_in_flight_per_connection a call is spread by; `security`: token,
    root_certificates, client_certificate, client_key (as the Python client
    takes them)."""

    def __init__(self, lib, target, timeout, max_message_bytes, transfer, security):
        self._lib = lib
        options = _Options(
            target=_text(target),
            # No deadline: a year (the C++ client always sets one).
            timeout_s=float(timeout) if timeout is not None else 365 * 86400.0,
            max_message_bytes=int(max_message_bytes),
            # It only sends calls large enough to spread.
            connections=int(transfer.connections or transfer.auto_connections),
            spread_request_bytes=int(transfer.slice_bytes),
            spread_requests_in_flight=int(transfer.slices_in_flight_per_connection),
            # Only rows whose CUDA region the caller chose are given on
            # their GPU (score(on_device=True)).
            cuda_shared_memory=1,
            bearer_token=_text(security.get("token")),
            tls_root_certs=_text(security.get("root_certificates")),
            tls_client_cert=_text(security.get("client_certificate")),
            tls_client_key=_text(security.get("client_key")),
        )
        handle = ctypes.c_void_p()
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        code = lib.detlogp_client_create(
            ctypes.byref(options), ctypes.byref(handle), error, _ERROR_BYTES
        )
        if code != 0:
            raise RuntimeError(
                f"the C++ client for {target}: {error.value.decode(errors='replace')}"
            )
        self._handle = handle

    def close(self):
        handle, self._handle = self._handle, None
        if handle:
            self._lib.detlogp_client_destroy(handle)

    def shared_memory_refusal(self):
        """Why the C++ client's region is not used ("" when none was
        refused)."""
        text = ctypes.create_string_buffer(_ERROR_BYTES)
        self._lib.detlogp_client_shared_memory_refusal(self._handle, text, _ERROR_BYTES)
        return text.value.decode(errors="replace")

    def score(self, call, timings=None, on_device=False, timeout=None):
        """(LogProbResult, path) for `call` (a transfer.LogProbCall), path
        being how its rows went ("grpc", "cuda_shm"); NativeCallFailed when
        the C++ client's call fails (DEADLINE_EXCEEDED past `timeout`
        seconds, None: the client's own). Its host rows in wire layout are
        sent; with `on_device`, its CUDA tensor (takes_device_rows) is copied
        on the caller's stream into the C++ client's CUDA region."""
        if on_device:
            tensor = call.cuda_tensor
            rows, device, stream = tensor.data_ptr(), tensor.device.index, call.cuda_stream
            stream = stream.cuda_stream
        else:
            rows, device, stream = _pointer(call.host_rows()), -1, None
        fields = call.fields
        n = call.rows
        k = int(fields.top_k)
        ids = np.ascontiguousarray(call.target_ids, dtype=np.int64)
        logprobs = np.empty(n, np.float32)
        lse = np.empty(n, np.float32) if fields.return_lse else None
        entropy = np.empty(n, np.float32) if fields.return_entropy else None
        top_ids = np.empty((n, k), np.int64) if k else None
        top_logprobs = np.empty((n, k), np.float32) if k else None
        request = _Request(
            request_id=_text(fields.request_id),
            dtype=int(call.dtype),
            rows=n,
            hidden_size=int(call.shape[1]),
            hidden=rows,
            device=device,
            stream=stream,
            target_ids=_pointer(ids),
            temperature=float(fields.temperature),
            return_lse=int(fields.return_lse),
            return_entropy=int(fields.return_entropy),
            return_timing=int(fields.return_timing),
            top_k=k,
            model=_text(fields.model),
            model_version=int(fields.model_version),
            timeout_s=float(timeout) if timeout is not None else 0.0,
        )
        answer = _Answer(
            logprobs=_pointer(logprobs),
            lse=_pointer(lse),
            entropy=_pointer(entropy),
            top_ids=_pointer(top_ids),
            top_logprobs=_pointer(top_logprobs),
        )
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        started = time.perf_counter()
        code = self._lib.detlogp_client_score(
            self._handle, ctypes.byref(request), ctypes.byref(answer), error, _ERROR_BYTES
        )
        elapsed = time.perf_counter() - started
        if code != 0:
            details = bytes(answer.error_details[: answer.error_details_len]) or None
            raise NativeCallFailed(code, error.value.decode(errors="replace"), details)
        if timings is not None:
            timings.record_native(elapsed, answer)
        result = LogProbResult(
            logprobs=logprobs,
            lse=lse,
            determinism_key=answer.determinism_key.decode(),
            request_id=fields.request_id,
            model=answer.model.decode(),
            model_version=int(answer.model_version),
            entropy=entropy,
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            path=answer.path.decode() or "grpc",
            engine="native",
        )
        if timings is not None:
            result.timings = timings
        return result, result.path
