"""Trainer-side ops with exactly the served bits (issue #14, first step: CPU).

The functions here run the server's own CPU kernels, built as a shared library
with a small C ABI (kernels/capi/detlogp_ops.h), on numpy arrays:

    linear_logp(hidden, weight, targets, ...)  log p(target) (and lse): the
                                               CPU server's bits
    h3_projection(x, weight, bias)            the H3 video input projection:
                                               the server's Project bits
    determinism_key(weight, ...)               the CPU server's determinism key
                                               for these weights

The library is found at $DETLOGP_OPS_LIBRARY, else at
bazel-bin/kernels/capi/libdetlogp_ops.so in the working directory or a folder
above it (`bazel build //kernels/capi:libdetlogp_ops.so`). It is loaded on the
first call, so the package imports without it. The CUDA ops are not built yet:
device="cuda" (or a CUDA tensor) raises NotImplementedError.
"""
import ctypes
import os
import pathlib
import threading

import numpy as np

from detlogp import tensors

__all__ = ["linear_logp", "h3_projection", "determinism_key", "find_library",
           "load_library", "LIBRARY_ENV", "H3_IN_DIM", "H3_OUT_DIM"]

LIBRARY_ENV = "DETLOGP_OPS_LIBRARY"
_LIBRARY_PATH = pathlib.Path("bazel-bin") / "kernels" / "capi" / "libdetlogp_ops.so"
_ABI_VERSION = 1
H3_IN_DIM = 96
H3_OUT_DIM = 5376
_ERROR_LEN = 1024
_KEY_LEN = 128

_lock = threading.Lock()
_lib = None

_u16p = ctypes.POINTER(ctypes.c_uint16)
_f32p = ctypes.POINTER(ctypes.c_float)
_i32p = ctypes.POINTER(ctypes.c_int32)
_i64 = ctypes.c_int64


def find_library(start=None):
    """$DETLOGP_OPS_LIBRARY, else bazel-bin/kernels/capi/libdetlogp_ops.so in
    `start` (or the working directory) or any folder above it; None if not
    found."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return pathlib.Path(env)
    here = pathlib.Path(start or os.getcwd()).resolve()
    for folder in [here, *here.parents]:
        candidate = folder / _LIBRARY_PATH
        if candidate.exists():
            return candidate
    return None


def load_library():
    """The loaded ctypes library (loaded once); RuntimeError naming what is
    missing when it cannot be found or loaded."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = find_library()
        if path is None:
            raise RuntimeError(
                f"detlogp.ops needs the CPU ops library libdetlogp_ops.so: set "
                f"${LIBRARY_ENV} to its path, or run `bazel build "
                f"//kernels/capi:libdetlogp_ops.so` in the detlogp repository and "
                f"work from inside it (looked for {_LIBRARY_PATH} in "
                f"{pathlib.Path.cwd()} and every folder above)")
        if not path.exists():
            raise RuntimeError(f"detlogp.ops: ${LIBRARY_ENV}={path} does not exist "
                               "(build it with `bazel build "
                               "//kernels/capi:libdetlogp_ops.so`)")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise RuntimeError(f"detlogp.ops: cannot load {path}: {error}") from None
        lib.detlogp_ops_abi_version.restype = ctypes.c_int
        lib.detlogp_ops_abi_version.argtypes = []
        if lib.detlogp_ops_abi_version() != _ABI_VERSION:
            raise RuntimeError(
                f"detlogp.ops: {path} has C ABI version "
                f"{lib.detlogp_ops_abi_version()}, this package wants {_ABI_VERSION} "
                "(rebuild the library from the same checkout as the package)")
        lib.detlogp_cpu_linear_logp.restype = ctypes.c_int
        lib.detlogp_cpu_linear_logp.argtypes = [
            _u16p, _i64, _i64, _f32p, _i64, _u16p, _i64, _i32p, _f32p,
            ctypes.c_int, _f32p, _f32p, ctypes.c_char_p, ctypes.c_size_t]
        lib.detlogp_cpu_h3_projection.restype = ctypes.c_int
        lib.detlogp_cpu_h3_projection.argtypes = [
            _f32p, _i64, _f32p, _f32p, ctypes.c_int, _f32p, ctypes.c_char_p,
            ctypes.c_size_t]
        lib.detlogp_cpu_determinism_key.restype = ctypes.c_int
        lib.detlogp_cpu_determinism_key.argtypes = [
            _u16p, _i64, _i64, _f32p, _i64, ctypes.c_char_p, ctypes.c_size_t,
            ctypes.c_char_p, ctypes.c_size_t]
        _lib = lib
        return lib


# ------------------------------------------------------------------ inputs
def _check_device(device, *arrays):
    """CPU only for now: device="cpu" and host arrays."""
    if device is not None and str(device).split(":")[0].lower() != "cpu":
        raise NotImplementedError(
            f"detlogp.ops: device {device!r}: only the CPU ops are built so far; "
            "the CUDA ops are not built yet (issue #14 continues)")
    for array in arrays:
        dlpack_device = getattr(array, "__dlpack_device__", None)
        if dlpack_device is None:
            continue
        try:
            kind = int(dlpack_device()[0])
        except Exception:  # not a usable DLPack device: treat as host data
            continue
        if kind not in (1, 3):  # kDLCPU, kDLCUDAHost
            raise NotImplementedError(
                f"detlogp.ops: a {type(array).__name__} on DLPack device type "
                f"{kind}: only the CPU ops are built so far; the CUDA ops are not "
                "built yet (issue #14 continues)")


def _host(array):
    if tensors.is_torch_tensor(array):
        return tensors.torch_to_numpy(array, bf16_bits=True)
    return np.asarray(array)


def _bf16_bits(array, name):
    """bf16 bits (uint16, C-contiguous) of float32/float16/float64 values
    rounded to nearest even as the server does, or of bf16 / uint16 bits."""
    array = _host(array)
    if array.dtype == np.uint16 or tensors._is_bf16(array.dtype):
        return np.ascontiguousarray(array.view(np.uint16))
    if array.dtype in (np.float32, np.float16, np.float64):
        return tensors.float32_to_bf16_bits(array.astype(np.float32, copy=False))
    raise TypeError(f"{name}: dtype {array.dtype} is not float32, float16, "
                    "bfloat16 (ml_dtypes) or uint16 bf16 bits")


def _float32(array, name):
    array = _host(array)
    if array.dtype not in (np.float32, np.float64, np.float16):
        raise TypeError(f"{name}: dtype {array.dtype} is not float32")
    return np.ascontiguousarray(array, dtype=np.float32)


def _ptr(array, kind):
    return None if array is None else array.ctypes.data_as(kind)


def _head(weight, bias, vocab_size):
    weight_bits = _bf16_bits(weight, "weight")
    if weight_bits.ndim != 2:
        raise ValueError(f"weight: expected [V_pad, H], got shape {weight_bits.shape}")
    padded, hidden_size = weight_bits.shape
    if vocab_size is None:
        vocab_size = padded
    vocab_size = int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size: must be in [1, {padded}] (the weight's rows), "
                         f"got {vocab_size}")
    bias32 = None
    if bias is not None:
        bias32 = _float32(bias, "bias")
        if bias32.shape != (padded,):
            raise ValueError(f"bias: expected shape ({padded},), got {bias32.shape}")
    return weight_bits, bias32, padded, hidden_size, vocab_size


def _raise(rc, error, what):
    if rc != 0:
        message = error.value.decode(errors="replace")
        raise ValueError(f"detlogp.ops.{what}: {message}")


# ------------------------------------------------------------------ ops
def linear_logp(hidden, weight, targets, bias=None, temperature=1.0,
                vocab_size=None, return_lse=False, *, num_threads=0, device=None):
    """log p(targets[r]) under softmax((hidden[r] . W^T + bias) / temperature)
    over the first vocab_size rows of W: the CPU server's bits for the same
    weights and rows.

    hidden [N, H] and weight [V_pad, H]: float32 (rounded to bf16, nearest
    even, as the server rounds fp32 input), ml_dtypes.bfloat16, or uint16 bf16
    bits. bias: [V_pad] float32 or None. temperature: a scalar or one per row,
    finite and > 0. vocab_size: the real vocabulary (rows beyond it are
    padding), default all rows. num_threads: 0 = all cores (bits never depend
    on it). Returns float32 logprobs [N], or (logprobs, lse) with return_lse.
    """
    _check_device(device, hidden, weight, targets, bias)
    weight_bits, bias32, padded, hidden_size, vocab_size = _head(weight, bias, vocab_size)
    hidden_bits = _bf16_bits(hidden, "hidden")
    if hidden_bits.ndim != 2 or hidden_bits.shape[1] != hidden_size:
        raise ValueError(f"hidden: expected [N, {hidden_size}] (the weight's H), "
                         f"got shape {hidden_bits.shape}")
    rows = hidden_bits.shape[0]
    targets_host = _host(targets)
    if targets_host.shape != (rows,):
        raise ValueError(f"targets: expected shape ({rows},), got {targets_host.shape}")
    if not np.issubdtype(targets_host.dtype, np.integer):
        raise TypeError(f"targets: dtype {targets_host.dtype} is not an integer type")
    bad = np.flatnonzero((targets_host < 0) | (targets_host >= vocab_size))
    if bad.size:
        raise ValueError(f"detlogp.ops.linear_logp: targets[{bad[0]}] = "
                         f"{targets_host[bad[0]]} is outside [0, {vocab_size})")
    targets32 = np.ascontiguousarray(targets_host, dtype=np.int32)
    temps = np.asarray(_host(temperature), dtype=np.float32)
    if temps.ndim == 0:
        temps = np.full(rows, temps, dtype=np.float32)
    elif temps.shape != (rows,):
        raise ValueError(f"temperature: expected a scalar or shape ({rows},), "
                         f"got {temps.shape}")
    temps = np.ascontiguousarray(temps)
    logprobs = np.empty(rows, dtype=np.float32)
    lse = np.empty(rows, dtype=np.float32)
    if rows:
        lib = load_library()
        error = ctypes.create_string_buffer(_ERROR_LEN)
        rc = lib.detlogp_cpu_linear_logp(
            _ptr(weight_bits, _u16p), padded, hidden_size, _ptr(bias32, _f32p),
            vocab_size, _ptr(hidden_bits, _u16p), rows, _ptr(targets32, _i32p),
            _ptr(temps, _f32p), int(num_threads), _ptr(logprobs, _f32p),
            _ptr(lse, _f32p), error, _ERROR_LEN)
        _raise(rc, error, "linear_logp")
    return (logprobs, lse) if return_lse else logprobs


def h3_projection(x, weight, bias=None, *, num_threads=0, device=None):
    """Y [R, 5376] = x [R, 96] . weight^T + bias in float32 with the fixed
    per-output fma order (kernels/projection.h): the server's Project bits.
    weight: [5376, 96] float32; bias: [5376] float32 or None."""
    _check_device(device, x, weight, bias)
    x32 = _float32(x, "x")
    if x32.ndim != 2 or x32.shape[1] != H3_IN_DIM:
        raise ValueError(f"x: expected [R, {H3_IN_DIM}], got shape {x32.shape}")
    w32 = _float32(weight, "weight")
    if w32.shape != (H3_OUT_DIM, H3_IN_DIM):
        raise ValueError(f"weight: expected shape ({H3_OUT_DIM}, {H3_IN_DIM}), "
                         f"got {w32.shape}")
    b32 = None
    if bias is not None:
        b32 = _float32(bias, "bias")
        if b32.shape != (H3_OUT_DIM,):
            raise ValueError(f"bias: expected shape ({H3_OUT_DIM},), got {b32.shape}")
    rows = x32.shape[0]
    y = np.empty((rows, H3_OUT_DIM), dtype=np.float32)
    lib = load_library()
    error = ctypes.create_string_buffer(_ERROR_LEN)
    rc = lib.detlogp_cpu_h3_projection(
        _ptr(x32, _f32p), rows, _ptr(w32, _f32p), _ptr(b32, _f32p),
        int(num_threads), _ptr(y, _f32p), error, _ERROR_LEN)
    _raise(rc, error, "h3_projection")
    return y


def determinism_key(weight, bias=None, vocab_size=None, *, device=None):
    """The determinism key the CPU server reports (ModelInfo.determinism_key)
    when it serves these weights: weight [V_pad, H] (float32 rounded to bf16,
    or bf16 bits), bias [V_pad] float32 or None, vocab_size (default all
    rows)."""
    _check_device(device, weight, bias)
    weight_bits, bias32, padded, hidden_size, vocab_size = _head(weight, bias, vocab_size)
    lib = load_library()
    key = ctypes.create_string_buffer(_KEY_LEN)
    error = ctypes.create_string_buffer(_ERROR_LEN)
    rc = lib.detlogp_cpu_determinism_key(
        _ptr(weight_bits, _u16p), padded, hidden_size, _ptr(bias32, _f32p),
        vocab_size, key, _KEY_LEN, error, _ERROR_LEN)
    _raise(rc, error, "determinism_key")
    return key.value.decode()
