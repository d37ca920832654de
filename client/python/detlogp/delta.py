"""The delta encoding of UploadModel (UPLOAD_ENCODING_XOR_ZSTD): one zstd
frame whose content is the bytewise XOR of the new payload (weight bytes,
then bias bytes) with the base version's payload. Unchanged bits are zero
bytes, which zstd squeezes to almost nothing; the server XORs the content
with its base again, so the rebuilt head is bit-exact by construction.

The XOR runs in blocks (numpy on the host; on the GPU with torch for CUDA
tensors, xor_bits), so no full-size temporary is made; zstd compresses on
every core. Needs the zstandard package (pip install zstandard), imported
only when a delta is made.
"""

import os

import numpy as np

# Bytes XORed and handed to zstd at a time.
BLOCK_BYTES = 16 << 20


def _zstd():
    try:
        import zstandard
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError(
            "delta uploads need the zstandard package: pip install zstandard"
        ) from error
    return zstandard


def available():
    """Whether deltas can be made here (the zstandard package imports)."""
    try:
        _zstd()
    except ImportError:
        return False
    return True


def _blocks(buffers, block_bytes):
    """(offset, view) pieces of the concatenated `buffers`, each within one
    buffer and at most block_bytes long."""
    offset = 0
    for view in buffers:
        view = memoryview(view).cast("B")
        for begin in range(0, len(view), block_bytes):
            yield offset + begin, view[begin : begin + block_bytes]
        offset += len(view)


def _xor(a, b):
    """a ^ b for two equal-length byte views, eight bytes at a time."""
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    if len(x) % 8 == 0:
        return np.bitwise_xor(x.view(np.uint64), y.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(x, y)


def compress_xor(xor_buffers, *, level=1, threads=None):
    """One zstd frame (with its content checksum) of `xor_buffers` laid end
    to end: XOR bits already made (on the host, or on a GPU)."""
    zstandard = _zstd()
    total = sum(memoryview(v).nbytes for v in xor_buffers)
    workers = (os.cpu_count() or 1) if threads is None else int(threads)
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=workers)
    stream = compressor.compressobj(size=total)
    out = [stream.compress(piece) for _, piece in _blocks(xor_buffers, BLOCK_BYTES)]
    out.append(stream.flush())
    return b"".join(out)


def encode_xor_delta(updated, base, *, level=1, threads=None):
    """One zstd frame of XOR(updated, base), each a list of byte buffers laid
    end to end, cut alike (an LmHead's weight and bias)."""
    updated_sizes = [memoryview(v).nbytes for v in updated]
    if [memoryview(v).nbytes for v in base] != updated_sizes:
        raise ValueError("base and new weights differ in size")
    zstandard = _zstd()
    workers = (os.cpu_count() or 1) if threads is None else int(threads)
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=workers)
    stream = compressor.compressobj(size=sum(updated_sizes))
    out = [
        stream.compress(_xor(piece, other))
        for (_, piece), (_, other) in zip(_blocks(updated, BLOCK_BYTES), _blocks(base, BLOCK_BYTES))
    ]
    out.append(stream.flush())
    return b"".join(out)


def decode_xor_delta(data, base):
    """The payload rebuilt from a delta frame and the base's buffers (tests;
    the server does this in C++)."""
    zstandard = _zstd()
    plain = zstandard.ZstdDecompressor().decompress(data)
    base_bytes = b"".join(bytes(memoryview(v).cast("B")) for v in base)
    if len(plain) != len(base_bytes):
        raise ValueError("the delta rebuilds another size than the base's")
    return _xor(plain, base_bytes).tobytes()


def xor_bits_on_device(updated, base):
    """For CUDA tensors (torch, bf16): the XOR of their bits computed on the
    GPU, copied to the host as a numpy uint16 array of the same shape. The
    base never leaves the GPU."""
    import torch  # reached only for torch tensors

    if updated.shape != base.shape or updated.dtype != base.dtype:
        raise ValueError(
            f"base is {base.dtype} {list(base.shape)}, the new weights "
            f"{updated.dtype} {list(updated.shape)}"
        )
    if updated.dtype != torch.bfloat16:
        raise TypeError("XOR on the GPU takes bf16 tensors (bits as sent)")
    bits = torch.bitwise_xor(updated.view(torch.int16), base.view(torch.int16))
    return bits.cpu().numpy().view(np.uint16)
