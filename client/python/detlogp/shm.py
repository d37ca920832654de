"""Shared-memory regions the client owns, so rows reach a server on the same
host without crossing gRPC (the server's SharedMemoryService, after Triton's
shared-memory extensions).

System regions hold host rows: a POSIX shared-memory object under /dev/shm,
created, sized with posix_fallocate (a full /dev/shm fails here, not with a
SIGBUS later), mapped, registered with the server, and then unlinked: the
server keeps its own mapping, so nothing is left in /dev/shm when this
process dies, even by SIGKILL; the server releases the memory after its
--shared_memory_idle_s.

CUDA regions hold rows on a GPU: a device buffer allocated with torch, its
allocation's cudaIpcMemHandle_t (libcuda through ctypes) registered with the
server, which opens it on the same GPU and copies rows device to device.

Each call takes slots (byte ranges) in a target's regions for its slices
and gives them back when answered: calls running at once never share a
slot. Regions grow on demand within TransferOptions.shared_memory_bytes per
target and kind, and are unregistered by Client.close() and at exit.
"""

import concurrent.futures
import contextlib
import ctypes
import ipaddress
import itertools
import mmap
import os
import secrets
import threading

import numpy as np

from detlogp import wire
from detlogp.v1 import detlogp_pb2 as pb

# Slot offsets are multiples of this (a page: aligned rows for any dtype,
# and the server's pinned-copy engine likes page-aligned sources).
SLOT_ALIGN_BYTES = 4096
SHM_DIR = "/dev/shm"
# The smallest region made (small calls share it).
MIN_REGION_BYTES = 4 << 20
_names = itertools.count()


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


def region_name(kind):
    """A name unique to this process and call: detlogp_<pid>_<kind>_<n>_<random>."""
    return f"detlogp_{os.getpid()}_{kind}_{next(_names)}_{secrets.token_hex(4)}"


class SystemRegion:
    """A POSIX shared-memory object of `byte_size` bytes, mapped here."""

    kind = "system"
    register_method = "SystemSharedMemoryRegister"
    unregister_method = "SystemSharedMemoryUnregister"

    def __init__(self, byte_size):
        self.name = region_name("sys")
        self.key = "/" + self.name
        self.byte_size = int(byte_size)
        self.base_offset = 0
        self._path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.byte_size)
            self._map = mmap.mmap(fd, self.byte_size)
        except BaseException:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)

    def unregister_request(self, pb):
        return pb.SystemSharedMemoryUnregisterRequest(name=self.name)

    def register_request(self, pb):
        return pb.SystemSharedMemoryRegisterRequest(
            name=self.name, key=self.key, offset=0, byte_size=self.byte_size
        )

    def after_register(self):
        """The server holds its own mapping now: drop the name."""
        self.unlink()

    def unlink(self):
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def host_view(self, offset, nbytes):
        """Bytes [offset, offset + nbytes) as a writable uint8 array."""
        return np.frombuffer(self._map, np.uint8, nbytes, offset)

    def close(self):
        self.unlink()
        try:
            self._map.close()
        except BufferError:  # a view is still alive; the GC unmaps it later
            pass


_CU_IPC_HANDLE_BYTES = 64
_libcuda = None


def _cuda_driver():
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
        lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        _libcuda = lib
    return _libcuda


@contextlib.contextmanager
def _primary_context(driver, ordinal):
    """The device's primary context (the one PyTorch's runtime uses) current
    on this thread: a thread that never called the runtime has none, and the
    driver API then fails with CUDA_ERROR_INVALID_CONTEXT."""
    device = ctypes.c_int()
    _check_cuda(driver.cuDeviceGet(ctypes.byref(device), int(ordinal)), "cuDeviceGet")
    context = ctypes.c_void_p()
    _check_cuda(
        driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
        "cuDevicePrimaryCtxRetain",
    )
    try:
        _check_cuda(driver.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        driver.cuDevicePrimaryCtxRelease_v2(device)


def _check_cuda(result, what):
    if result != 0:
        raise OSError(f"{what} failed with CUresult {result}")


class CudaRegion:
    """A device buffer on `device` (a torch.device of type cuda) whose
    allocation is shared through a CUDA IPC handle. The region registered
    starts at the allocation's base (what the handle opens to); the buffer
    starts `base_offset` bytes into it."""

    kind = "cuda"
    register_method = "CudaSharedMemoryRegister"
    unregister_method = "CudaSharedMemoryUnregister"

    def __init__(self, byte_size, device):
        import torch  # CUDA regions exist only for torch CUDA tensors

        self.name = region_name(f"cuda{device.index}")
        self.device = device
        with torch.cuda.device(device):
            self.buffer = torch.empty(int(byte_size), dtype=torch.uint8, device=device)
            pointer = self.buffer.data_ptr()
            driver = _cuda_driver()
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            handle = ctypes.create_string_buffer(_CU_IPC_HANDLE_BYTES)
            with _primary_context(driver, device.index):
                _check_cuda(
                    driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer),
                    "cuMemGetAddressRange",
                )
                _check_cuda(driver.cuIpcGetMemHandle(handle, base.value), "cuIpcGetMemHandle")
        self.raw_handle = handle.raw
        self.base_offset = pointer - base.value
        self.byte_size = self.base_offset + int(byte_size)

    def unregister_request(self, pb):
        return pb.CudaSharedMemoryUnregisterRequest(name=self.name)

    def register_request(self, pb):
        return pb.CudaSharedMemoryRegisterRequest(
            name=self.name,
            raw_handle=self.raw_handle,
            device_id=int(self.device.index),
            byte_size=self.byte_size,
        )

    def after_register(self):
        pass

    def device_view(self, offset, nbytes):
        """Bytes [offset, offset + nbytes) of the buffer as a uint8 tensor."""
        return self.buffer[offset : offset + nbytes]

    def close(self):
        self.buffer = None


class Slot:
    """Bytes [offset, offset + nbytes) of `region`, held by one slice."""

    __slots__ = ("region", "offset", "nbytes")

    def __init__(self, region, offset, nbytes):
        self.region, self.offset, self.nbytes = region, offset, nbytes

    @property
    def ref_offset(self):
        """The offset a request names (from the registered region's start)."""
        return self.region.base_offset + self.offset


class RowCopier:
    """Copies host rows into system regions with several threads (numpy
    releases the GIL while it copies): one thread moves about 4 GB/s, and
    a slice the server waits for should arrive as soon as it can. A call's
    slices take turns (LogProbCall.copy_lock), so the first is complete
    and sent while the next is copied."""

    MIN_PARALLEL_BYTES = 4 << 20

    def __init__(self, threads):
        self.threads = max(int(threads), 1)
        self._pool = None
        self._lock = threading.Lock()

    def copy(self, dest, source):
        """dest[...] = source, row blocks side by side."""
        parts = min(self.threads, max(source.nbytes // self.MIN_PARALLEL_BYTES, 1))
        if parts <= 1 or len(source) < parts:
            np.copyto(dest, source)
            return
        bounds = [len(source) * i // parts for i in range(parts + 1)]
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="detlogp-copy"
                )
            pool = self._pool
        rest = [
            pool.submit(np.copyto, dest[lo:hi], source[lo:hi])
            for lo, hi in zip(bounds[1:-1], bounds[2:])
        ]
        np.copyto(dest[: bounds[1]], source[: bounds[1]])
        for future in rest:
            future.result()

    def close(self):
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class Staging:
    """One slice's rows on their way into a slot: the target's memory, the
    kind and pool, the bytes, and how to make a region for them."""

    def __init__(self, memory, kind, call, piece, want_bytes, copier=None):
        self.memory, self.kind, self.call, self.piece = memory, kind, call, piece
        self.copier = copier
        self.nbytes = piece.rows * call.row_bytes
        self.want_bytes = want_bytes
        self.device = call.cuda_tensor.device if kind == "cuda" else None
        self.pool = memory.pool(kind, self.device)

    def make_region(self, byte_size):
        return make_region_within(self.kind, byte_size, self.nbytes, self.device)

    def fill(self, slot):
        """The rows copied into `slot`; the slot (released on failure)."""
        try:
            copy_rows_in(self.call, self.piece, slot, self.copier)
        except BaseException:
            self.pool.release(slot)
            raise
        return slot


class NeedRegion:
    """try_acquire's answer when a new region of `byte_size` must be made
    (the caller creates and registers it, then calls add() or abandon())."""

    def __init__(self, byte_size):
        self.byte_size = byte_size


class RegionPool:
    """Slots in the regions of one kind on one target, within a byte budget.

    try_acquire gives a Slot, a NeedRegion (to one caller at a time), or
    None (wait: every byte is held by slices in flight; `changed` is
    notified when one is released)."""

    def __init__(self, budget_bytes, region_bytes):
        self.budget_bytes = int(budget_bytes)
        self.region_bytes = int(region_bytes)
        self.changed = threading.Condition()
        self._regions = []  # [region, sorted [(offset, nbytes)] in use]
        self._creating = False

    @staticmethod
    def _aligned(nbytes):
        return -(-max(int(nbytes), 1) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES

    def held_bytes(self):
        return sum(entry[0].byte_size - entry[0].base_offset for entry in self._regions)

    def try_acquire(self, nbytes, want_bytes=0):
        """A slot of `nbytes`; a new region is made `want_bytes` large (room
        for the slices a call keeps in flight), at least MIN_REGION_BYTES,
        twice the largest region so far, and at most the pool's
        region_bytes and budget."""
        size = self._aligned(nbytes)
        with self.changed:
            for entry in self._regions:
                offset = self._fit(entry, size)
                if offset is not None:
                    return Slot(entry[0], offset, int(nbytes))
            if self._creating:
                return None
            left = self.budget_bytes - self.held_bytes()
            if size > self.budget_bytes:
                raise MemoryError(
                    f"a slice of {size} bytes is over TransferOptions.shared_memory_bytes "
                    f"({self.budget_bytes})"
                )
            if size > left:
                if not any(entry[1] for entry in self._regions):
                    # Idle regions too small: free them for one that fits.
                    self._creating = True
                    grow = self._aligned(max(int(want_bytes), MIN_REGION_BYTES))
                    return NeedRegion(max(size, min(self.region_bytes, self.budget_bytes, grow)))
                return None
            self._creating = True
            largest = max((e[0].byte_size - e[0].base_offset for e in self._regions), default=0)
            grow = max(int(want_bytes), MIN_REGION_BYTES, 2 * largest)
            return NeedRegion(max(size, min(self.region_bytes, left, self._aligned(grow))))

    def _fit(self, entry, size):
        region, used = entry
        capacity = region.byte_size - region.base_offset
        cursor = 0
        for index, (offset, length) in enumerate(used):
            if offset - cursor >= size:
                used.insert(index, (cursor, size))
                return cursor
            cursor = offset + length
        if capacity - cursor >= size:
            used.append((cursor, size))
            return cursor
        return None

    def idle_regions_to_drop(self, byte_size):
        """Idle regions to give up so a region of `byte_size` fits the
        budget (removed from the pool; the caller unregisters them)."""
        with self.changed:
            dropped = []
            while self._regions and self.held_bytes() + byte_size > self.budget_bytes:
                idle = next((e for e in self._regions if not e[1]), None)
                if idle is None:
                    break
                self._regions.remove(idle)
                dropped.append(idle[0])
            self._creating = True
            return dropped

    def add(self, region):
        with self.changed:
            self._regions.append([region, []])
            self._creating = False
            self.changed.notify_all()

    def abandon(self):
        """The region asked for could not be made."""
        with self.changed:
            self._creating = False
            self.changed.notify_all()

    def release(self, slot):
        with self.changed:
            for entry in self._regions:
                if entry[0] is slot.region:
                    entry[1] = [u for u in entry[1] if u[0] != slot.offset]
                    break
            self.changed.notify_all()

    def forget(self, region):
        """The server no longer knows `region` (released for idleness, or
        restarted): new slots go elsewhere; its slots in flight are released
        as usual."""
        with self.changed:
            self._regions = [e for e in self._regions if e[0] is not region]
            self.changed.notify_all()

    def take_all(self):
        """Every region, removed from the pool (for close())."""
        with self.changed:
            regions = [entry[0] for entry in self._regions]
            self._regions = []
            return regions


# Errors that say the server will not read this kind of region from this
# client (flag off, not a local peer, byte bound, no such GPU, an old server):
# the client falls back to gRPC bytes, says why once, and asks again later.
REFUSAL_RETRY_S = 60.0


class TargetMemory:
    """The shared-memory state of one target: which kinds of region it
    refused (and when), the system pool and a CUDA pool per device."""

    def __init__(self, target, options):
        self.target = target
        self.same_host = is_same_host(target)
        self.mode = options.shared_memory
        self.min_bytes = options.shared_memory_min_bytes
        self.budget_bytes = options.shared_memory_bytes
        # A region holds a large call's slices in flight.
        in_flight = options.region_slices
        self.system = RegionPool(self.budget_bytes, options.system_slice_bytes * in_flight)
        self.cuda_region_bytes = options.cuda_slice_bytes * in_flight
        self.cuda = {}  # device index -> RegionPool
        self._refused = {}  # kind -> monotonic time of the refusal
        self._said = set()
        self._lock = threading.Lock()

    def kind_for(self, call, now):
        """ "cuda", "system" or None (gRPC bytes) for `call` on this target."""
        if self.mode == "off" or (self.mode == "auto" and not self.same_host):
            return None
        if call.hidden_bytes < self.min_bytes:
            return None
        usable = [
            k for k in ("cuda", "system") if now - self._refused.get(k, -1e18) > REFUSAL_RETRY_S
        ]
        # CUDA regions hold bf16 rows only (the server converts fp32 and fp16
        # on the host path): other CUDA tensors go through a system region.
        cuda_rows = call.cuda_tensor is not None and call.dtype == pb.DTYPE_BFLOAT16
        if cuda_rows and self.mode in ("auto", "cuda") and "cuda" in usable:
            return "cuda"
        if self.mode in ("auto", "system") and "system" in usable:
            return "system"
        return None

    def pool(self, kind, device=None):
        if kind == "system":
            return self.system
        with self._lock:
            if device.index not in self.cuda:
                self.cuda[device.index] = RegionPool(self.budget_bytes, self.cuda_region_bytes)
            return self.cuda[device.index]

    def refused(self, kind, now, why, log):
        """Records that `kind` was refused; logs `why` once per kind and
        reason."""
        self._refused[kind] = now
        key = (kind, type(why).__name__, str(getattr(why, "code", "")))
        if key not in self._said:
            self._said.add(key)
            reason = str(why).rstrip(": ") or type(why).__name__
            if type(why).__name__ == "Unimplemented":
                reason = f"the server offers no shared memory ({reason})"
            log.warning(
                "%s shared memory with %s is not used, rows go over gRPC "
                "(asked again in %.0f s): %s",
                kind,
                self.target,
                REFUSAL_RETRY_S,
                reason,
            )

    def pools(self):
        return [self.system, *self.cuda.values()]

    def pool_of(self, slot):
        if slot.region.kind == "system":
            return self.system
        return self.cuda[slot.region.device.index]


def make_region_within(kind, byte_size, needed_bytes, device=None):
    """A new region of `kind`, not yet registered: `byte_size` bytes, or
    only `needed_bytes` when there is no room for more (/dev/shm or the GPU
    nearly full)."""
    make = SystemRegion if kind == "system" else lambda size: CudaRegion(size, device)
    try:
        return make(byte_size)
    except (OSError, MemoryError, RuntimeError):
        if byte_size <= needed_bytes:
            raise
    return make(RegionPool._aligned(needed_bytes))


def region_ref(call, piece, slot):
    """The wire.RegionRef naming the slice's rows in `slot` (None: none)."""
    if slot is None:
        return None
    return wire.RegionRef(slot.region.name, slot.ref_offset, piece.rows * call.row_bytes)


def path_name(slot):
    """How a slice's rows travelled, for CallTimings.path."""
    if slot is None:
        return "grpc"
    return "cuda_shm" if slot.region.kind == "cuda" else "system_shm"


def copy_rows_in(call, piece, slot, copier=None):
    """Writes rows [piece.start, piece.stop) of `call` into `slot`: host rows
    with one copy (by `copier`, a RowCopier, when given); a CUDA tensor into
    a CUDA slot on the caller's stream (waited for before the request is
    sent), or into a system slot."""
    nbytes = piece.rows * call.row_bytes
    if slot.region.kind == "cuda":
        import torch  # CUDA slots exist only for torch tensors

        source = call.cuda_tensor[piece.start : piece.stop]
        target = slot.region.device_view(slot.offset, nbytes).view(source.dtype)
        with torch.cuda.stream(call.cuda_stream):
            target.view(source.shape).copy_(source)
            done = torch.cuda.Event()
            done.record(call.cuda_stream)
        done.synchronize()
        return
    view = slot.region.host_view(slot.offset, nbytes)
    if call.cuda_tensor is not None and call.host_rows_cached() is None:
        call.slice_host_rows(piece, out=view)  # straight into the region
        return
    rows = call.host_rows()[piece.start : piece.stop]
    dest = view.view(rows.dtype).reshape(rows.shape)
    if copier is None:
        np.copyto(dest, rows)
        return
    with call.copy_lock:
        copier.copy(dest, rows)
