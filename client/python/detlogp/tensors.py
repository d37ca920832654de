"""numpy <-> detlogp.v1.Tensor conversion, and bf16 rounding like the server's.

Accepted hidden dtypes: float32, float16, ml_dtypes.bfloat16, and uint16 taken
as raw bf16 bits. float64 is cast to float32 first (the server defines its
bf16 conversion from fp32). Data is sent little-endian, row-major.
"""
import numpy as np

from detlogp.v1 import detlogp_pb2 as pb

try:  # optional: a real bfloat16 numpy dtype
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None
    BFLOAT16 = None


def _is_bf16(dtype):
    return BFLOAT16 is not None and dtype == BFLOAT16


def to_tensor(array):
    """Packs a 2-D (or any-rank) numpy array into a Tensor message."""
    array = np.asarray(array)
    if array.dtype.byteorder not in ("=", "|"):
        array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    if array.dtype == np.float32:
        dtype, wire = pb.DTYPE_FLOAT32, np.dtype("<f4")
    elif array.dtype == np.float16:
        dtype, wire = pb.DTYPE_FLOAT16, np.dtype("<f2")
    elif array.dtype == np.uint16 or _is_bf16(array.dtype):
        dtype, wire = pb.DTYPE_BFLOAT16, np.dtype("<u2")
        array = array.view(np.uint16)
    else:
        raise TypeError(
            f"hidden dtype {array.dtype} is not float32, float16, bfloat16 "
            "(ml_dtypes) or uint16 bf16 bits")
    data = np.ascontiguousarray(array, dtype=wire).tobytes()
    return pb.Tensor(dtype=dtype, shape=list(array.shape), data=data)


def from_tensor(tensor):
    """Unpacks a Tensor message into a numpy array of its dtype (bf16 comes
    back as ml_dtypes.bfloat16 if installed, else as uint16 bits)."""
    if tensor.dtype == pb.DTYPE_FLOAT32:
        dtype = np.dtype("<f4")
    elif tensor.dtype == pb.DTYPE_FLOAT16:
        dtype = np.dtype("<f2")
    elif tensor.dtype == pb.DTYPE_BFLOAT16:
        dtype = np.dtype("<u2")
    else:
        raise ValueError(f"tensor dtype {tensor.dtype} is not supported")
    array = np.frombuffer(tensor.data, dtype=dtype).reshape(tuple(tensor.shape))
    array = array.astype(dtype.newbyteorder("="), copy=False)  # native order
    if tensor.dtype == pb.DTYPE_BFLOAT16 and BFLOAT16 is not None:
        array = array.view(BFLOAT16)
    return array


def float32_to_bf16_bits(values):
    """Rounds float32 values to bf16 bits, round-to-nearest-even, NaN kept
    quiet: what the server does to every fp32 input."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def bf16_bits_to_float32(bits):
    """Widens bf16 bits to float32 exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
