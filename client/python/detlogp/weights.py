"""lm_head weights for ModelRepositoryService.UploadModel: the bf16 bytes the
server takes, the model's digest, and the upload's messages.

The wire form (docs/live_weights.md): weight [V_pad, H] as bf16, row-major,
little-endian; optional bias [V_pad] as fp32. The digest is SHA-256 over

    "detlogp-lm-head-v2 H=<H> V=<vocab_size> V_pad=<V_pad> bias=<0|1> block=16777216\\n"

then the raw SHA-256 of every 16 MiB block of the weight bytes, then of the
bias bytes (vocab_size 0 means V_pad); blocks hash on every core.

Accepted weights:
  numpy float32 / float16 / float64   rounded to bf16 by round-to-nearest-even
                                      (tensors.float32_to_bf16_bits, the
                                      server's rule; float64 goes through
                                      float32 first, as hidden rows do), in
                                      blocks of rows: one bf16 buffer is made,
                                      never a full float32 copy
  numpy ml_dtypes.bfloat16 or uint16  taken as bf16 bits, no copy when
                                      C-contiguous and little-endian
  torch tensors (CPU or CUDA)         bfloat16 viewed as int16 and copied to
                                      the host as they are (no float32
                                      detour); float types as numpy's, CUDA
                                      ones copied through pinned memory
                                      (tensors.torch_to_numpy). torch is
                                      imported only when a torch tensor is
                                      passed.
The bias: any float array or tensor of V_pad values, sent as fp32.
A Hugging Face checkpoint directory or .safetensors file: LmHead.from_checkpoint
(the head found as the server finds it, docs/checkpoints.md).
"""

import concurrent.futures
import dataclasses
import hashlib
import os

import numpy as np

from detlogp import checkpoint, delta, safetensors_io, tensors
from detlogp.tensors import is_torch_tensor
from detlogp.v1 import detlogp_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 << 20
# Elements rounded per block when a float weight is converted to bf16: the
# float32 temporaries stay ~16 MiB whatever the weight's size.
_ROUND_BLOCK_ELEMENTS = 1 << 22


def _torch_to_numpy(tensor, *, for_weight):
    import torch  # reached only for torch tensors, so torch is installed

    if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"torch dtype {tensor.dtype} is not bfloat16, float16, float32 or float64")
    # The weight's bf16 bits as they are; a bf16 bias widened to fp32 exactly.
    return tensors.torch_to_numpy(tensor, bf16_bits=for_weight)


def weight_bits(weight):
    """The weight as a C-contiguous little-endian uint16 array of bf16 bits
    (see the module's docstring for what is accepted)."""
    if is_torch_tensor(weight):
        weight = _torch_to_numpy(weight, for_weight=True)
    array = np.asarray(weight)
    kind, size = array.dtype.kind, array.dtype.itemsize
    if tensors.BFLOAT16 is not None and array.dtype == tensors.BFLOAT16:
        array = array.view(np.uint16)
        kind = "u"
    if kind == "u" and size == 2:
        return np.ascontiguousarray(array, dtype="<u2")
    if kind != "f" or size not in (2, 4, 8):
        raise TypeError(
            f"weight dtype {array.dtype} is not float32, float16, float64, "
            "bfloat16 (ml_dtypes or torch) or uint16 bf16 bits"
        )
    if array.ndim == 0:
        raise ValueError("weight must be [padded_vocab_size, hidden_size]")
    out = np.empty(array.shape, dtype="<u2")
    rows = array.shape[0]
    per_row = max(1, int(np.prod(array.shape[1:])))
    step = max(1, _ROUND_BLOCK_ELEMENTS // per_row)
    for begin in range(0, rows, step):
        block = array[begin : begin + step].astype(np.float32)  # fp16: exact
        out[begin : begin + step] = tensors.float32_to_bf16_bits(block)
    return out


def bias_values(bias, padded_vocab_size):
    """The bias as a C-contiguous little-endian float32 [padded_vocab_size]."""
    if is_torch_tensor(bias):
        bias = _torch_to_numpy(bias, for_weight=False)
    array = np.asarray(bias)
    is_bf16 = tensors.BFLOAT16 is not None and array.dtype == tensors.BFLOAT16
    if array.dtype.kind != "f" and not is_bf16:
        raise TypeError(f"bias dtype {array.dtype} is not a float type")
    if array.shape != (padded_vocab_size,):
        raise ValueError(
            f"bias has shape {list(array.shape)}; expected "
            f"[{padded_vocab_size}] (one fp32 per weight row)"
        )
    return np.ascontiguousarray(array, dtype="<f4")


DIGEST_BLOCK_BYTES = 16 << 20


def digest_preamble(hidden_size, vocab_size, padded_vocab_size, has_bias):
    """The ASCII line the model digest starts with."""
    return (
        f"detlogp-lm-head-v2 H={hidden_size} V={vocab_size} "
        f"V_pad={padded_vocab_size} bias={1 if has_bias else 0} "
        f"block={DIGEST_BLOCK_BYTES}\n"
    ).encode("ascii")


def _leaf(view):
    return hashlib.sha256(view).digest()  # releases the GIL: leaves hash in parallel


def block_digest(preamble, buffers, threads=None):
    """SHA-256 over `preamble` and the raw SHA-256 of every 16 MiB block of
    each buffer in turn (docs/live_weights.md)."""
    blocks = [
        view[begin : begin + DIGEST_BLOCK_BYTES]
        for view in buffers
        for begin in range(0, len(view), DIGEST_BLOCK_BYTES)
    ]
    workers = threads or min(32, os.cpu_count() or 1)
    if workers > 1 and len(blocks) > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            leaves = list(pool.map(_leaf, blocks))
    else:
        leaves = [_leaf(block) for block in blocks]
    return hashlib.sha256(preamble + b"".join(leaves)).hexdigest()


class LmHead:
    """An lm_head ready to upload: bf16 weight bits and an fp32 bias held
    once; `messages()` yields the UploadModel stream from memoryview slices
    of them, hashing while it yields.

    vocab_size: the real vocabulary (rows beyond it are padding); None or 0
    means every row.
    """

    def __init__(self, weight, bias=None, vocab_size=None):
        self.weight = weight_bits(weight)
        if self.weight.ndim != 2:
            raise ValueError(
                f"weight has shape {list(self.weight.shape)}; expected "
                "[padded_vocab_size, hidden_size]"
            )
        self.padded_vocab_size, self.hidden_size = (int(n) for n in self.weight.shape)
        self.bias = None if bias is None else bias_values(bias, self.padded_vocab_size)
        self.vocab_size = int(vocab_size or 0)
        self.source = None  # where the weights were read from, when from a file
        self._sha256 = None

    @property
    def has_bias(self):
        return self.bias is not None

    @property
    def nbytes(self):
        """Bytes the upload carries (weight and bias)."""
        return self.weight.nbytes + (self.bias.nbytes if self.has_bias else 0)

    def preamble(self):
        return digest_preamble(
            self.hidden_size,
            self.vocab_size or self.padded_vocab_size,
            self.padded_vocab_size,
            self.has_bias,
        )

    def _buffers(self):
        """The bytes in wire order, as memoryviews (no copies)."""
        views = [memoryview(self.weight.reshape(-1).view(np.uint8))]
        if self.has_bias:
            views.append(memoryview(self.bias.view(np.uint8)))
        return views

    def sha256(self):
        """The digest the server will report as weights_sha256 (its 16 MiB
        blocks hashed on every core)."""
        if self._sha256 is None:
            self._sha256 = block_digest(self.preamble(), self._buffers())
        return self._sha256

    def header(self, model, version=None, weights_sha256=None):
        return pb.UploadModelHeader(
            model=model,
            dtype=pb.DTYPE_BFLOAT16,
            shape=[self.padded_vocab_size, self.hidden_size],
            vocab_size=self.vocab_size,
            has_bias=self.has_bias,
            model_version=int(version or 0),
            weights_sha256=weights_sha256 or self.sha256(),
        )

    def delta_against(self, base, base_version, *, level=1, threads=None):
        """This head as a delta against `base` (an LmHead of the same shape,
        the weights the servers hold as version `base_version`): an LmHeadDelta
        whose bytes are one zstd frame of the XOR of the two payloads
        (UPLOAD_ENCODING_XOR_ZSTD, docs/live_weights.md "Delta uploads")."""
        if not isinstance(base, LmHead):
            raise TypeError("base must be an LmHead (LmHead.coerce(weights))")
        if (base.weight.shape, base.has_bias, base.vocab_size or base.padded_vocab_size) != (
            self.weight.shape,
            self.has_bias,
            self.vocab_size or self.padded_vocab_size,
        ):
            raise ValueError(
                f"base has shape {list(base.weight.shape)} bias={base.has_bias}; "
                f"the new weights {list(self.weight.shape)} bias={self.has_bias}"
            )
        if int(base_version) <= 0:
            raise ValueError(f"base_version {base_version} is not a version (> 0)")
        data = delta.encode_xor_delta(
            self._buffers(), base._buffers(), level=level, threads=threads
        )
        return LmHeadDelta(int(base_version), base.sha256(), self.sha256(), data)

    def delta_messages(self, model, lm_head_delta, chunk_bytes=DEFAULT_CHUNK_BYTES, version=None):
        """The UploadModel stream of a delta: the header naming the base, then
        the delta's bytes in chunks of `chunk_bytes`."""
        chunk_bytes = int(chunk_bytes)
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        header = self.header(model, version, lm_head_delta.weights_sha256)
        header.encoding = pb.UPLOAD_ENCODING_XOR_ZSTD
        header.base_version = lm_head_delta.base_version
        header.base_weights_sha256 = lm_head_delta.base_weights_sha256
        yield pb.UploadModelRequest(header=header)
        view = memoryview(lm_head_delta.data)
        for begin in range(0, len(view), chunk_bytes):
            yield pb.UploadModelRequest(chunk=bytes(view[begin : begin + chunk_bytes]))

    def messages(self, model, chunk_bytes=DEFAULT_CHUNK_BYTES, weights_sha256=None, version=None):
        """The UploadModel stream: the header (with the digest), then the
        weight's and the bias's bytes in chunks of `chunk_bytes`.
        `weights_sha256`, when given, is sent instead of the computed digest:
        the server then refuses bytes that do not hash to it (DATA_LOSS).
        `version`: the number to publish the weights as (None: the model's
        next number on the server)."""
        chunk_bytes = int(chunk_bytes)
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        yield pb.UploadModelRequest(header=self.header(model, version, weights_sha256))
        for view in self._buffers():
            for begin in range(0, len(view), chunk_bytes):
                yield pb.UploadModelRequest(chunk=bytes(view[begin : begin + chunk_bytes]))

    @classmethod
    def from_checkpoint(cls, path, lm_head_tensor=None, bias_tensor=None, vocab_size=None):
        """The head of a Hugging Face checkpoint directory or a .safetensors
        file, found by the server's rules (detlogp.checkpoint.resolve_head:
        lm_head.weight, else the tied input embedding; lm_head.bias when
        present). Only the head's bytes are read; other tensors, whatever
        their dtype, are skipped. `.source` says which tensor of which file."""
        head = checkpoint.resolve_head(path, lm_head_tensor, bias_tensor)
        weight = safetensors_io.read_tensor(head.weight_file, head.weight_tensor, mmap=True)
        if head.weight_dtype == "BF16":
            weight = weight.view(np.uint16)
        bias = None
        if head.bias_tensor:
            bias = safetensors_io.read_tensor(head.bias_file, head.bias_tensor)
            if bias.dtype == np.uint16:  # BF16 bits, widened exactly
                bias = (bias.astype(np.uint32) << 16).view(np.float32)
        lm_head = cls(weight, bias, vocab_size)
        lm_head.source = head.description
        return lm_head

    @classmethod
    def coerce(cls, weight, bias=None, vocab_size=None):
        """`weight` as an LmHead: one already made, a checkpoint path (then
        `bias` is the bias tensor's name or None), or an array or tensor."""
        if isinstance(weight, cls):
            return weight
        if isinstance(weight, (str, os.PathLike)):
            if bias is not None and not isinstance(bias, str):
                raise TypeError("with a checkpoint path, bias is a tensor name (or None)")
            return cls.from_checkpoint(weight, bias_tensor=bias, vocab_size=vocab_size)
        return cls(weight, bias, vocab_size)


@dataclasses.dataclass(frozen=True)
class LmHeadDelta:
    """A head encoded against a base version (LmHead.delta_against): sent
    to every replica holding the base, which rebuilds the head and checks
    weights_sha256 before publishing it."""

    base_version: int
    base_weights_sha256: str
    weights_sha256: str
    data: bytes

    @property
    def nbytes(self):
        return len(self.data)


def lm_head_sha256(weight, bias=None, vocab_size=None):
    """The weights_sha256 the server reports for these weights."""
    return LmHead(weight, bias, vocab_size).sha256()
