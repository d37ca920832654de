"""numpy <-> detlogp.v1.Tensor conversion, torch tensors to numpy, and bf16
rounding like the server's.

Accepted hidden dtypes: float32, float16, ml_dtypes.bfloat16, and uint16 taken
as raw bf16 bits. float64 is cast to float32 first (the server defines its
bf16 conversion from fp32). Data is sent little-endian, row-major.

torch tensors (CPU or CUDA) are taken too: bfloat16 as its bits (viewed as
int16, no float32 detour), float16 and float32 as themselves; a CUDA tensor
is copied to the host once, through pinned memory. torch is imported only
when a torch tensor is passed (is_torch_tensor looks at the type alone).
"""

import numpy as np

from detlogp.v1 import detlogp_pb2 as pb

try:  # optional: a real bfloat16 numpy dtype
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None
    BFLOAT16 = None


def is_bf16_dtype(dtype):
    """True for ml_dtypes' bfloat16 (False when ml_dtypes is missing)."""
    return BFLOAT16 is not None and dtype == BFLOAT16


def is_torch_tensor(value):
    """True for a torch.Tensor, without importing torch."""
    return type(value).__module__.split(".", 1)[0] == "torch" and hasattr(value, "detach")


def _torch_to_host(tensor):
    """A CPU tensor as it is; a CUDA one copied to the host once, into pinned
    memory (a pageable copy of 1.2 GB took 1.08 s on an H200 host, a pinned
    one a fraction of it; torch caches pinned blocks across calls)."""
    import torch  # reached only for torch tensors, so torch is installed

    if tensor.device.type == "cpu":
        return tensor
    if tensor.is_cuda:
        host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        return host
    return tensor.cpu()


def cuda_rows_to_host(rows, stream, out=None):
    """CUDA rows (bfloat16, float16 or float32) copied to the host on
    `stream`, the stream they were written on, and waited for: into `out`
    (a host numpy array of their size in bytes) or into pinned memory
    (torch caches pinned blocks). Returns the host rows in wire layout
    (bfloat16 as uint16 bits), a numpy array."""
    import torch  # reached only for torch tensors, so torch is installed

    bf16 = rows.dtype == torch.bfloat16
    with torch.cuda.stream(stream):
        source = rows.detach()
        if bf16:
            source = source.view(torch.int16)
        source = source.contiguous()
        if out is None:
            host = torch.empty(tuple(source.shape), dtype=source.dtype, pin_memory=True)
        else:
            host = torch.from_numpy(out).view(source.dtype).view(source.shape)
        host.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    array = host.numpy()
    return array.view(np.uint16) if bf16 else array


def torch_to_numpy(tensor, *, bf16_bits=True):
    """A torch tensor's values as a numpy array of the same dtype, on the
    host. bfloat16 comes back as uint16 bits (bf16_bits, no float32 detour)
    or widened to float32 exactly (bf16_bits=False)."""
    import torch  # reached only for torch tensors, so torch is installed

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        if not bf16_bits:
            return _torch_to_host(tensor.to(torch.float32)).numpy()
        # A view of the bits, then one device-to-host copy (none on the CPU).
        bits = _torch_to_host(tensor.contiguous().view(torch.int16))
        return bits.numpy().view(np.uint16)
    return _torch_to_host(tensor).numpy()


def torch_hidden_to_numpy(tensor):
    """Hidden rows from a torch tensor: bfloat16 as uint16 bits (sent as
    DTYPE_BFLOAT16), float16 and float32 as themselves, float64 as numpy's
    (cast to float32 by to_tensor)."""
    import torch  # reached only for torch tensors, so torch is installed

    if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"hidden torch dtype {tensor.dtype} is not bfloat16, float16 or float32")
    return torch_to_numpy(tensor)


def target_ids(targets):
    """N target ids as a list of ints: any integer numpy array, sequence, or
    integer torch tensor (CPU or CUDA)."""
    if is_torch_tensor(targets):
        import torch  # reached only for torch tensors, so torch is installed

        dtype = targets.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"targets torch dtype {dtype} is not an integer type")
        targets = torch_to_numpy(targets)
    ids = np.asarray(targets).reshape(-1)
    if ids.dtype.kind in "iu":
        return ids.tolist()
    return [int(t) for t in ids]


def hidden_wire_array(array):
    """(DType number, a C-contiguous little-endian array) for hidden rows
    given as a numpy array or a torch tensor (see the module's docstring):
    the bytes a Tensor's `data` holds. No copy when the array already has
    its wire layout; TypeError for other dtypes."""
    if is_torch_tensor(array):
        array = torch_hidden_to_numpy(array)
    array = np.asarray(array)
    if array.dtype.byteorder not in ("=", "|"):
        array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    if array.dtype == np.float32:
        dtype, wire = pb.DTYPE_FLOAT32, np.dtype("<f4")
    elif array.dtype == np.float16:
        dtype, wire = pb.DTYPE_FLOAT16, np.dtype("<f2")
    elif array.dtype == np.uint16 or is_bf16_dtype(array.dtype):
        dtype, wire = pb.DTYPE_BFLOAT16, np.dtype("<u2")
        array = array.view(np.uint16)
    else:
        raise TypeError(
            f"hidden dtype {array.dtype} is not float32, float16, bfloat16 "
            "(ml_dtypes) or uint16 bf16 bits"
        )
    return dtype, np.ascontiguousarray(array, dtype=wire)


def to_tensor(array):
    """Packs a 2-D (or any-rank) numpy array, or a torch tensor (see the
    module's docstring), into a Tensor message."""
    dtype, array = hidden_wire_array(array)
    return pb.Tensor(dtype=dtype, shape=list(array.shape), data=array.tobytes())


def target_id_array(targets):
    """N target ids as an int64 numpy array: any integer numpy array,
    sequence, or integer torch tensor (CPU or CUDA). ValueError for ids
    outside int64 (what protobuf refuses too)."""
    if is_torch_tensor(targets):
        import torch  # reached only for torch tensors, so torch is installed

        dtype = targets.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"targets torch dtype {dtype} is not an integer type")
        targets = torch_to_numpy(targets)
    ids = np.asarray(targets).reshape(-1)
    if ids.dtype.kind == "i":
        return ids.astype(np.int64, copy=False)
    if ids.dtype.kind == "u":
        if ids.size and int(ids.max()) >= 1 << 63:
            raise ValueError(f"target_ids: {int(ids.max())} is outside int64")
        return ids.astype(np.int64)
    try:
        return np.array([int(t) for t in ids], dtype=np.int64)
    except OverflowError:
        raise ValueError("target_ids: a value is outside int64") from None


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
