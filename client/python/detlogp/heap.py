"""Keeps freed heap memory in the process for reuse (glibc's malloc).

A large call's requests are built in, and copied by grpcio into, buffers of
several MiB. With glibc's defaults each such buffer is mapped for it and
unmapped when freed, so every request is written into fresh pages: a page
fault and a zeroed 4 KiB page for every 4 KiB sent, taken while grpcio holds
the GIL. Keeping freed memory lets the next request reuse the pages.

Process-wide, like the server's --keep_freed_memory_mb, so the program
decides: the client never calls it by itself.

    import detlogp
    detlogp.keep_freed_memory()  # once, early in a rollout worker
"""

import ctypes
import ctypes.util

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mib=1024):
    """Lets glibc's malloc keep up to `mib` MiB of freed memory for reuse
    (M_TRIM_THRESHOLD) and serve buffers up to min(mib, 256) MiB from its
    heap (M_MMAP_THRESHOLD). Returns True when set, False when this process's
    malloc is not glibc's. ValueError outside [1, 2047]."""
    mib = int(mib)
    if not 1 <= mib <= 2047:
        raise ValueError(f"keep_freed_memory: mib={mib} is outside [1, 2047]")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    kept = mib << 20
    return (
        mallopt(_M_MMAP_THRESHOLD, min(kept, 256 << 20)) == 1
        and mallopt(_M_TRIM_THRESHOLD, kept) == 1
    )
