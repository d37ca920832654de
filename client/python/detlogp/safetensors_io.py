"""A minimal .safetensors writer/reader for numpy arrays (writes F32, F16,
BF16, I32 and I64; reads those and the other integer and F64 tensors
checkpoints carry).

Format: 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the data.
Used to hand the server a known lm_head (--weights) in tests and tools.
"""

import json
import os
import struct

import numpy as np

from detlogp import tensors

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}

# Dtypes a reader can hand back; tensors of others (F8_E4M3, ...) are
# skipped by read() and refused by read_tensor().
_READ_DTYPES = {
    **_DTYPES,
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


def _dtype_name(array):
    if array.dtype == np.float32:
        return "F32"
    if array.dtype == np.float16:
        return "F16"
    if array.dtype == np.uint16 or (
        tensors.BFLOAT16 is not None and array.dtype == tensors.BFLOAT16
    ):
        return "BF16"  # uint16 arrays are taken as bf16 bits
    if array.dtype == np.int64:
        return "I64"  # buffers checkpoints carry (model.position_ids)
    if array.dtype == np.int32:
        return "I32"
    raise TypeError(f"unsupported dtype {array.dtype}")


def to_bytes(named_arrays):
    """Serializes {name: array} to safetensors bytes (insertion order)."""
    header, chunks, offset = {}, [], 0
    for name, array in named_arrays.items():
        array = np.asarray(array)
        dtype = _dtype_name(array)
        data = np.ascontiguousarray(
            array.view(np.uint16) if dtype == "BF16" else array, dtype=_READ_DTYPES[dtype]
        ).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # align the data section
    return struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(chunks)


def write(path, named_arrays):
    with open(path, "wb") as f:
        f.write(to_bytes(named_arrays))


def _read_header_and_offset(path):
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: too short")
        (length,) = struct.unpack("<Q", prefix)
        size = os.fstat(f.fileno()).st_size
        if length > min(size - 8, 100 << 20):
            raise ValueError(f"{path}: header length {length} is invalid")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def read_header(path):
    """{name: {"dtype", "shape", "data_offsets"}} from the file's header
    alone (no tensor bytes are read)."""
    return _read_header_and_offset(path)[0]


def read_tensor(path, name, mmap=False):
    """One tensor (BF16 as uint16 bits), reading only its bytes; with
    mmap=True a read-only view of the mapped file."""
    return _tensor(path, name, *_read_header_and_offset(path), mmap=mmap)


def _tensor(path, name, header, data_offset, mmap):
    meta = header.get(name)
    if meta is None:
        raise KeyError(f"{path}: no tensor named '{name}'")
    dtype = _READ_DTYPES.get(meta["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {meta['dtype']}")
    begin, end = meta["data_offsets"]
    count = (end - begin) // dtype.itemsize
    if count * dtype.itemsize != end - begin or count != int(np.prod(meta["shape"])):
        raise ValueError(f"{path}: tensor '{name}' byte range does not match its shape")
    if mmap:
        return np.memmap(
            path, dtype=dtype, mode="r", offset=data_offset + begin, shape=(count,)
        ).reshape(meta["shape"])
    with open(path, "rb") as f:
        f.seek(data_offset + begin)
        data = f.read(end - begin)
    if len(data) != end - begin:
        raise ValueError(f"{path}: tensor '{name}' runs past the end of the file")
    return np.frombuffer(data, dtype=dtype).reshape(meta["shape"])


def read(path, mmap=False):
    """Returns {name: array} (BF16 as uint16 bits; tensors of dtypes numpy
    has no type for are left out). With mmap=True the arrays are read-only
    views of the file mapped into memory (nothing is read until used: for
    multi-GB lm_heads)."""
    header, data_offset = _read_header_and_offset(path)
    names = [name for name, meta in header.items() if meta["dtype"] in _READ_DTYPES]
    if mmap:
        return {name: _tensor(path, name, header, data_offset, True) for name in names}
    with open(path, "rb") as f:
        f.seek(data_offset)
        data = f.read()
    out = {}
    for name in names:
        meta = header[name]
        begin, end = meta["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype=_READ_DTYPES[meta["dtype"]]).reshape(
            meta["shape"]
        )
    return out
