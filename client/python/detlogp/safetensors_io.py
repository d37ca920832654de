"""A minimal .safetensors writer/reader for numpy arrays (F32, F16, BF16).

Format: 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the data.
Used to hand the server a known lm_head (--weights) in tests and tools.
"""

import json
import struct

import numpy as np

from detlogp import tensors

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def _dtype_name(array):
    if array.dtype == np.float32:
        return "F32"
    if array.dtype == np.float16:
        return "F16"
    if array.dtype == np.uint16 or (
        tensors.BFLOAT16 is not None and array.dtype == tensors.BFLOAT16
    ):
        return "BF16"  # uint16 arrays are taken as bf16 bits
    raise TypeError(f"unsupported dtype {array.dtype}")


def to_bytes(named_arrays):
    """Serializes {name: array} to safetensors bytes (insertion order)."""
    header, chunks, offset = {}, [], 0
    for name, array in named_arrays.items():
        array = np.asarray(array)
        dtype = _dtype_name(array)
        data = np.ascontiguousarray(
            array.view(np.uint16) if dtype == "BF16" else array, dtype=_DTYPES[dtype]
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


def read(path, mmap=False):
    """Returns {name: array} (BF16 as uint16 bits). With mmap=True the arrays
    are read-only views of the file mapped into memory (nothing is read
    until used: for multi-GB lm_heads)."""
    if mmap:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        out = {}
        for name, meta in header.items():
            begin, end = meta["data_offsets"]
            dtype = _DTYPES.get(meta["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {meta['dtype']}")
            count = (end - begin) // dtype.itemsize
            out[name] = np.memmap(
                path, dtype=dtype, mode="r", offset=8 + length + begin, shape=(count,)
            ).reshape(meta["shape"])
        return out
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header.pop("__metadata__", None)
    data = blob[8 + length :]
    out = {}
    for name, meta in header.items():
        begin, end = meta["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype=_DTYPES[meta["dtype"]]).reshape(
            meta["shape"]
        )
    return out
