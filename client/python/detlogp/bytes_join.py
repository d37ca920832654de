"""Joins buffers into one bytes object without holding the GIL for the copy.

grpcio sends `bytes`, so a request's rows must be copied into one. b"".join
copies with the GIL held: a client sending slices from several threads then
copies one slice at a time, and grpcio's own copy into its send buffer (also
under the GIL) waits behind it. On CPython, `join` instead allocates the
bytes object uninitialised and fills it with ctypes.memmove, which releases
the GIL; the object is not visible to any other code until it is full.
Elsewhere (or when the self-check at import fails) it is b"".join.
"""

import ctypes
import sys

import numpy as np

# Below this the GIL is held only briefly either way.
GIL_FREE_MIN_BYTES = 1 << 20


def _raw_bytes_writer():
    """(PyBytes_FromStringAndSize, the offset of a bytes object's data from
    its id()) on CPython, else None."""
    if sys.implementation.name != "cpython":
        return None
    try:
        new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
        new_bytes.restype = ctypes.py_object
        new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
        # PyBytesObject: the header, then ob_sval (its last member, declared
        # char[1], counted in __basicsize__).
        offset = bytes.__basicsize__ - 1
        probe = new_bytes(None, 16)
        ctypes.memmove(id(probe) + offset, b"detlogp-selfchk!", 16)
        if probe != b"detlogp-selfchk!":
            return None
    except (AttributeError, OSError, TypeError, ValueError):
        return None
    return new_bytes, offset


_WRITER = _raw_bytes_writer()


def _address(part):
    """The address of a bytes-like object's first byte (read-only is fine)."""
    return np.frombuffer(part, dtype=np.uint8).ctypes.data


def join(parts):
    """b"".join(parts) for bytes-like parts (C-contiguous buffers)."""
    views = [memoryview(part).cast("B") for part in parts]
    total = sum(view.nbytes for view in views)
    if _WRITER is None or total < GIL_FREE_MIN_BYTES:
        return b"".join(views)
    new_bytes, offset = _WRITER
    out = new_bytes(None, total)
    address = id(out) + offset
    for view in views:
        if view.nbytes:
            ctypes.memmove(address, _address(view), view.nbytes)
            address += view.nbytes
    return out
