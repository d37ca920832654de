"""Trainer-side ops with exactly the served bits.

The functions here run the server's own kernels, built as shared libraries
with small C ABIs (kernels/capi/detlogp_ops.h for the CPU kernels,
kernels/capi/detlogp_ops_cuda.h for the CUDA ones):

    linear_logp(hidden, weight, targets, ...)  log p(target) (and lse,
                                               entropy): the served bits
    h3_projection(x, weight, bias)            the H3 video input projection:
                                               the server's Project bits
    determinism_key(weight, ..., device=)      the server's determinism key
                                               for these weights on that device

Numpy arrays (and CPU torch tensors) run the CPU kernels and give the CPU
server's bits. CUDA arrays (torch tensors, or anything DLPack-capable such as
cupy arrays, which go through torch.from_dlpack without a copy) run the CUDA
kernels the server's --logp_kernel=auto picks for their GPU (the Hopper kernel
on compute capability 9.0, the portable one on other GPUs >= 8.0) on the
current CUDA stream and give the CUDA server's bits; outputs
are allocated by PyTorch's caching allocator and the weight is never copied.
For autograd, use detlogp.torch.

detlogp.libraries finds and loads the libraries (its functions are
re-exported here); asking for CUDA where the CUDA library, PyTorch or a GPU
of compute capability >= 8.0 is missing raises RuntimeError naming what is
missing.
"""

import ctypes
import threading

import numpy as np

from detlogp import tensors
from detlogp.libraries import (
    CUDA_LIBRARY_ENV,
    ERROR_BUFFER_BYTES,
    FLOAT_POINTER,
    INT32_POINTER,
    LIBRARY_ENV,
    UINT16_POINTER,
    cuda_available,
    find_cuda_library,
    find_library,
    find_library_file,
    load_cuda_library,
    load_library,
)

__all__ = [
    "linear_logp",
    "h3_projection",
    "determinism_key",
    "find_library",
    "find_library_file",
    "load_library",
    "find_cuda_library",
    "load_cuda_library",
    "cuda_available",
    "LIBRARY_ENV",
    "CUDA_LIBRARY_ENV",
    "H3_IN_DIM",
    "H3_OUT_DIM",
]

H3_IN_DIM = 96
H3_OUT_DIM = 5376
_KEY_LEN = 128


# ------------------------------------------------------------------ inputs
def _is_cuda_array(array):
    """True for a torch CUDA tensor or a DLPack array on a CUDA device."""
    if array is None or isinstance(array, (int, float, np.ndarray, np.generic)):
        return False
    if tensors.is_torch_tensor(array):
        return array.device.type == "cuda"
    dlpack_device = getattr(array, "__dlpack_device__", None)
    if dlpack_device is None:
        return False
    try:
        kind = int(dlpack_device()[0])
    except Exception:  # not a usable DLPack device: treat as host data
        return False
    if kind in (1, 3):  # kDLCPU, kDLCUDAHost
        return False
    if kind in (2, 13):  # kDLCUDA, kDLCUDAManaged
        return True
    raise ValueError(
        f"detlogp.ops: a {type(array).__name__} on DLPack device "
        f"type {kind}: only CPU and CUDA arrays are supported"
    )


def _wants_cuda(device, named):
    """True when the call runs on CUDA: device="cuda[:N]" or CUDA arrays. All
    array arguments must then be on CUDA (and on the CPU otherwise)."""
    on_cuda = {name: _is_cuda_array(array) for name, array in named.items() if array is not None}
    kind = None if device is None else str(device).split(":")[0].lower()
    if kind not in (None, "cpu", "cuda"):
        raise ValueError(f"detlogp.ops: device {device!r} is neither 'cpu' nor 'cuda'")
    if kind is None:
        kind = "cuda" if any(on_cuda.values()) else "cpu"
    wrong = [name for name, cuda in on_cuda.items() if cuda != (kind == "cuda")]
    if wrong:
        raise ValueError(
            f"detlogp.ops: {', '.join(wrong)} not on the {kind.upper()} like the "
            f"call ({'device=' + repr(device) if device is not None else 'the other arrays'}): "
            "pass every array on one device (no hidden copies are made)"
        )
    return kind == "cuda"


def _torch():
    try:
        import torch
    except ImportError as error:
        raise RuntimeError(
            "detlogp.ops on CUDA needs PyTorch (its CUDA tensors, caching allocator "
            f"and streams): `import torch` failed: {error}"
        ) from None
    return torch


def _as_torch(array, name):
    """A torch tensor for a CUDA array: itself, or a zero-copy DLPack view."""
    torch = _torch()
    if array is None or isinstance(array, torch.Tensor):
        return array
    try:
        return torch.from_dlpack(array)
    except Exception as error:
        raise TypeError(
            f"{name}: cannot view a {type(array).__name__} as a CUDA tensor through DLPack: {error}"
        ) from None


def _like_input(tensor, template):
    """Output tensor as the caller's framework: torch as is, else DLPack."""
    if tensor is None or tensors.is_torch_tensor(template):
        return tensor
    module = __import__(type(template).__module__.split(".", 1)[0])
    from_dlpack = getattr(module, "from_dlpack", None)
    return from_dlpack(tensor) if from_dlpack is not None else tensor


def _host(array):
    if tensors.is_torch_tensor(array):
        return tensors.torch_to_numpy(array, bf16_bits=True)
    if _is_cuda_array(array):  # e.g. cupy: one copy to the host
        return tensors.torch_to_numpy(_as_torch(array, "array"), bf16_bits=True)
    return np.asarray(array)


def _bf16_bits(array, name):
    """bf16 bits (uint16, C-contiguous) of float32/float16/float64 values
    rounded to nearest even as the server does, or of bf16 / uint16 bits."""
    array = _host(array)
    if array.dtype == np.uint16 or tensors.is_bf16_dtype(array.dtype):
        return np.ascontiguousarray(array.view(np.uint16))
    if array.dtype in (np.float32, np.float16, np.float64):
        return tensors.float32_to_bf16_bits(array.astype(np.float32, copy=False))
    raise TypeError(
        f"{name}: dtype {array.dtype} is not float32, float16, "
        "bfloat16 (ml_dtypes) or uint16 bf16 bits"
    )


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
        raise ValueError(
            f"vocab_size: must be in [1, {padded}] (the weight's rows), got {vocab_size}"
        )
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


# ------------------------------------------------------------------ CUDA
class _LmHeadCache:
    """LinearLogpCuda handles (the weight's TMA tensor map) by the weight
    tensor's address, shape and bias: a handle holds pointers, never data, so
    a handle found for the same address and shape is valid for whatever
    tensor lives there now (a weight updated in place, or a new one in the
    same allocation). Bounded; evicted handles are destroyed."""

    def __init__(self, capacity=16):
        self._capacity = capacity
        self._handles = {}
        self._lock = threading.Lock()

    def get(self, lib, weight, bias, vocab_size, device):
        key = (
            weight.data_ptr(),
            tuple(weight.shape),
            0 if bias is None else bias.data_ptr(),
            int(vocab_size),
            int(device),
        )
        with self._lock:
            handle = self._handles.pop(key, None)
            if handle is not None:
                self._handles[key] = handle  # most recently used last
                return handle
        handle = ctypes.c_void_p()
        error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
        rc = lib.detlogp_cuda_lm_head_create(
            weight.data_ptr(),
            weight.shape[0],
            weight.shape[1],
            None if bias is None else bias.data_ptr(),
            int(vocab_size),
            int(device),
            ctypes.byref(handle),
            error,
            ERROR_BUFFER_BYTES,
        )
        _raise(rc, error, "linear_logp")
        with self._lock:
            self._handles[key] = handle
            while len(self._handles) > self._capacity:
                old = self._handles.pop(next(iter(self._handles)))
                lib.detlogp_cuda_lm_head_destroy(old)
        return handle


_lm_heads = _LmHeadCache()


def _stream(torch, device):
    return torch.cuda.current_stream(device).cuda_stream


_errors = threading.local()


def _error_buffer():
    """This thread's message buffer for the C ABI (one allocation per
    thread, not per call)."""
    buffer = getattr(_errors, "buffer", None)
    if buffer is None:
        buffer = _errors.buffer = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    return buffer


def _cuda_call(weight, vocab_size):
    """(torch, the CUDA library, weight's device, its index, the real
    vocabulary) for a call on `weight`'s GPU."""
    torch = _torch()
    lib = load_cuda_library()
    device = weight.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    vocab_size = weight.shape[0] if vocab_size is None else int(vocab_size)
    return torch, lib, device, index, vocab_size


def _temperature_args(torch, temperatures):
    """(device pointer or None, scalar) for the C ABI: a float32 [N] tensor
    read in place, or one Python float for every row."""
    if isinstance(temperatures, torch.Tensor):
        return temperatures.data_ptr(), 1.0
    return None, float(temperatures)


def cuda_linear_logp(
    hidden, weight, targets, temperatures, bias=None, vocab_size=None, return_entropy=False
):
    """The CUDA server's linear-logp on torch CUDA tensors, checked by the
    caller (detlogp.torch and linear_logp below do): hidden bf16 [N, H] and
    weight bf16 [V_pad, H] contiguous, targets int32 or int64 [N] contiguous
    (read in place), temperatures float32 [N] contiguous or one Python float
    for every row, bias float32 [V_pad] or None, all on one GPU. Runs on the
    current stream without synchronizing; returns (logprobs, lse, entropy or
    None), float32 [N]. A target outside [0, vocab_size) gives NaN.

    The forward's whole GPU work is the library's two kernels: outputs and
    workspace come uninitialized from the caching allocator and nothing is
    filled, converted or copied (twin_check.py's overhead check counts the
    kernels)."""
    torch, lib, device, index, vocab_size = _cuda_call(weight, vocab_size)
    rows = hidden.shape[0]
    logprobs = torch.empty((rows,), dtype=torch.float32, device=device)
    lse = torch.empty((rows,), dtype=torch.float32, device=device)
    entropy = torch.empty((rows,), dtype=torch.float32, device=device) if return_entropy else None
    if rows == 0:
        return logprobs, lse, entropy
    handle = _lm_heads.get(lib, weight, bias, vocab_size, index)
    workspace_bytes = lib.detlogp_cuda_linear_logp_workspace_bytes(
        handle, rows, 1 if return_entropy else 0
    )
    workspace = torch.empty((max(int(workspace_bytes), 16),), dtype=torch.uint8, device=device)
    temps_ptr, temperature = _temperature_args(torch, temperatures)
    error = _error_buffer()
    rc = lib.detlogp_cuda_linear_logp(
        handle,
        hidden.data_ptr(),
        rows,
        targets.data_ptr(),
        1 if targets.dtype == torch.int64 else 0,
        temps_ptr,
        temperature,
        logprobs.data_ptr(),
        lse.data_ptr(),
        None if entropy is None else entropy.data_ptr(),
        workspace.data_ptr(),
        workspace.numel(),
        torch.cuda.current_stream(index).cuda_stream,
        error,
        ERROR_BUFFER_BYTES,
    )
    _raise(rc, error, "linear_logp")
    return logprobs, lse, entropy


def cuda_fused_backward_available(weight, bias=None, vocab_size=None):
    """Whether weight's GPU has the fused linear-logp backward (the Hopper
    kernel, compute capability 9.0): cuda_linear_logp_backward runs there."""
    torch, lib, device, index, vocab_size = _cuda_call(weight, vocab_size)
    handle = _lm_heads.get(lib, weight, bias, vocab_size, index)
    return lib.detlogp_cuda_linear_logp_backward_workspace_bytes(handle, 1, 1, 0) >= 0


def cuda_linear_logp_backward(
    hidden,
    weight,
    targets,
    lse,
    *,
    temperatures=1.0,
    bias=None,
    vocab_size=None,
    entropy=None,
    grad_logprobs=None,
    grad_lse=None,
    grad_entropy=None,
    need_hidden=True,
    need_weight=True,
    need_bias=False,
    weight_grad_dtype=None,
    hidden_grad_dtype=None,
):
    """The fused, batch-invariant linear-logp backward on torch CUDA tensors
    (sm_90a, kernel sm90a-wgmma-bwd-v1; docs/kernels.md). Inputs as
    cuda_linear_logp's (hidden bf16), plus the forward's lse (and entropy,
    needed with grad_entropy) and upstream gradients float32 [N] contiguous
    or None (zero). Returns (grad_hidden in hidden_grad_dtype (default:
    hidden's), grad_weight in weight_grad_dtype (default: weight's),
    grad_bias float32), each None when not asked for; bf16 or float32 each.
    A row's grad_hidden bits depend only on that row; grad_weight and
    grad_bias are the same bits run to run. Runs on the current stream."""
    torch, lib, device, index, vocab_size = _cuda_call(weight, vocab_size)
    rows = hidden.shape[0]
    weight_grad_dtype = weight.dtype if weight_grad_dtype is None else weight_grad_dtype
    hidden_grad_dtype = hidden.dtype if hidden_grad_dtype is None else hidden_grad_dtype
    if hidden.dtype != torch.bfloat16:
        raise ValueError(f"hidden: the backward reads bf16 (as the forward), got {hidden.dtype}")
    for name, dtype in (
        ("hidden_grad_dtype", hidden_grad_dtype),
        ("weight_grad_dtype", weight_grad_dtype),
    ):
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{name}: gradients are bf16 or float32, got {dtype}")
    grad_hidden = (
        torch.empty((rows, weight.shape[1]), dtype=hidden_grad_dtype, device=device)
        if need_hidden
        else None
    )
    grad_weight = (
        torch.empty(tuple(weight.shape), dtype=weight_grad_dtype, device=device)
        if need_weight
        else None
    )
    grad_bias = (
        torch.empty((weight.shape[0],), dtype=torch.float32, device=device) if need_bias else None
    )
    if rows == 0 or not (need_hidden or need_weight or need_bias):
        for g in (grad_hidden, grad_weight, grad_bias):
            if g is not None:
                g.zero_()
        return grad_hidden, grad_weight, grad_bias
    handle = _lm_heads.get(lib, weight, bias, vocab_size, index)
    hidden_bf16 = 1 if need_hidden and hidden_grad_dtype == torch.bfloat16 else 0
    workspace_bytes = lib.detlogp_cuda_linear_logp_backward_workspace_bytes(
        handle, rows, hidden_bf16, 1 if need_bias else 0
    )
    if workspace_bytes < 0:
        raise ValueError(
            "detlogp.ops.linear_logp_backward: this GPU has no "
            "backward kernel (needs compute capability 9.0)"
        )
    workspace = torch.empty((max(int(workspace_bytes), 256),), dtype=torch.uint8, device=device)
    temps_ptr, temperature = _temperature_args(torch, temperatures)

    def ptr(t):
        return None if t is None else t.data_ptr()

    error = _error_buffer()
    rc = lib.detlogp_cuda_linear_logp_backward(
        handle,
        hidden.data_ptr(),
        rows,
        targets.data_ptr(),
        1 if targets.dtype == torch.int64 else 0,
        temps_ptr,
        temperature,
        lse.data_ptr(),
        ptr(entropy),
        ptr(grad_logprobs),
        ptr(grad_lse),
        ptr(grad_entropy),
        ptr(grad_hidden),
        hidden_bf16,
        ptr(grad_weight),
        1 if weight_grad_dtype == torch.bfloat16 else 0,
        ptr(grad_bias),
        workspace.data_ptr(),
        workspace.numel(),
        torch.cuda.current_stream(index).cuda_stream,
        error,
        ERROR_BUFFER_BYTES,
    )
    _raise(rc, error, "linear_logp_backward")
    return grad_hidden, grad_weight, grad_bias


def cuda_h3_projection(x, weight, bias=None):
    """The H3 projection forward on torch CUDA float32 tensors (x [R, 96],
    weight [5376, 96], bias [5376] or None, contiguous, one GPU), on the
    current stream: y [R, 5376] float32."""
    torch = _torch()
    lib = load_cuda_library()
    device = weight.device.index
    rows = x.shape[0]
    y = torch.empty((rows, H3_OUT_DIM), dtype=torch.float32, device=weight.device)
    workspace = torch.empty(
        (int(lib.detlogp_cuda_h3_projection_forward_workspace_bytes()),),
        dtype=torch.uint8,
        device=weight.device,
    )
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    rc = lib.detlogp_cuda_h3_projection_forward(
        x.data_ptr() if rows else None,
        rows,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr() if rows else None,
        workspace.data_ptr(),
        workspace.numel(),
        device,
        _stream(torch, device),
        error,
        ERROR_BUFFER_BYTES,
    )
    _raise(rc, error, "h3_projection")
    return y


def cuda_h3_projection_input_grad(dy, weight):
    """dx [R, 96] = dy [R, 5376] . weight on CUDA (the batch-invariant dX
    kernel, the CPU's bits)."""
    torch = _torch()
    lib = load_cuda_library()
    device = weight.device.index
    rows = dy.shape[0]
    dx = torch.empty((rows, H3_IN_DIM), dtype=torch.float32, device=weight.device)
    need = int(lib.detlogp_cuda_h3_projection_input_grad_workspace_bytes(rows))
    workspace = torch.empty((need,), dtype=torch.uint8, device=weight.device) if need > 0 else None
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    rc = lib.detlogp_cuda_h3_projection_input_grad(
        dy.data_ptr() if rows else None,
        rows,
        weight.data_ptr(),
        dx.data_ptr() if rows else None,
        None if workspace is None else workspace.data_ptr(),
        need,
        device,
        _stream(torch, device),
        error,
        ERROR_BUFFER_BYTES,
    )
    _raise(rc, error, "h3_projection (dX)")
    return dx


def cuda_h3_projection_weight_grad(dy, x, with_bias=True, first_key=0):
    """(dweight [5376, 96], dbias [5376] or None) of one batch on CUDA, row i
    keyed first_key + i (the batch-invariant dW/dbias kernels, the CPU's
    bits)."""
    torch = _torch()
    lib = load_cuda_library()
    device = x.device.index
    rows = x.shape[0]
    dweight = torch.empty((H3_OUT_DIM, H3_IN_DIM), dtype=torch.float32, device=x.device)
    dbias = torch.empty((H3_OUT_DIM,), dtype=torch.float32, device=x.device) if with_bias else None
    need = int(lib.detlogp_cuda_h3_projection_weight_grad_workspace_bytes(rows, int(first_key)))
    if need < 0:
        raise ValueError(f"detlogp.ops.h3_projection: bad rows {rows} or first_key {first_key}")
    workspace = torch.empty((need,), dtype=torch.uint8, device=x.device) if need > 0 else None
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    rc = lib.detlogp_cuda_h3_projection_weight_grad(
        dy.data_ptr() if rows else None,
        x.data_ptr() if rows else None,
        rows,
        int(first_key),
        dweight.data_ptr(),
        None if dbias is None else dbias.data_ptr(),
        None if workspace is None else workspace.data_ptr(),
        need,
        device,
        _stream(torch, device),
        error,
        ERROR_BUFFER_BYTES,
    )
    _raise(rc, error, "h3_projection (dW)")
    return dweight, dbias


def cpu_h3_projection_input_grad(dy, weight, num_threads=0):
    """dx [R, 96] (numpy float32) = dy [R, 5376] . weight, the CPU kernel."""
    dy32, w32 = _float32(dy, "dy"), _float32(weight, "weight")
    rows = dy32.shape[0]
    dx = np.empty((rows, H3_IN_DIM), dtype=np.float32)
    lib = load_library()
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    rc = lib.detlogp_cpu_h3_projection_input_grad(
        _ptr(w32, FLOAT_POINTER),
        _ptr(dy32, FLOAT_POINTER),
        rows,
        int(num_threads),
        _ptr(dx, FLOAT_POINTER),
        error,
        ERROR_BUFFER_BYTES,
    )
    _raise(rc, error, "h3_projection (dX)")
    return dx


def cpu_h3_projection_weight_grad(dy, x, with_bias=True, first_key=0, num_threads=0):
    """(dweight [5376, 96], dbias [5376] or None), numpy float32, of one batch
    whose row i has key first_key + i: the CPU kernels."""
    dy32, x32 = _float32(dy, "dy"), _float32(x, "x")
    rows = x32.shape[0]
    dweight = np.empty((H3_OUT_DIM, H3_IN_DIM), dtype=np.float32)
    dbias = np.empty(H3_OUT_DIM, dtype=np.float32) if with_bias else None
    lib = load_library()
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    rc = lib.detlogp_cpu_h3_projection_weight_grad(
        _ptr(dy32, FLOAT_POINTER),
        _ptr(x32, FLOAT_POINTER),
        rows,
        int(first_key),
        int(num_threads),
        _ptr(dweight, FLOAT_POINTER),
        _ptr(dbias, FLOAT_POINTER),
        error,
        ERROR_BUFFER_BYTES,
    )
    _raise(rc, error, "h3_projection (dW)")
    return dweight, dbias


def _cuda_prepare_linear_logp(hidden, weight, targets, bias, temperature, vocab_size):
    """Checks torch CUDA inputs and returns them as the kernel takes them.
    hidden float32 is rounded to bf16 (a copy of hidden, as the server rounds
    fp32 input); the weight must already be bf16 and contiguous (it is never
    copied); int32 and int64 targets are read in place; a scalar temperature
    stays a Python float (no [N] tensor is filled)."""
    torch = _torch()
    if weight.dtype != torch.bfloat16:
        raise TypeError(
            f"weight: dtype {weight.dtype}: the CUDA kernel reads a "
            "bfloat16 weight in place (convert it once, outside the "
            "loop; it is never copied per call)"
        )
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"weight: expected a contiguous [V_pad, H] tensor, got "
            f"shape {tuple(weight.shape)} strides {weight.stride()}"
        )
    padded, hidden_size = weight.shape
    device = weight.device
    if hidden.device != device:
        raise ValueError(f"hidden: on {hidden.device}, weight on {device}")
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(
            f"hidden: expected [N, {hidden_size}] (the weight's H), got shape {tuple(hidden.shape)}"
        )
    if hidden.dtype == torch.float32:
        hidden = hidden.to(torch.bfloat16)
    elif hidden.dtype != torch.bfloat16:
        raise TypeError(f"hidden: dtype {hidden.dtype} is not bfloat16 or float32")
    hidden = hidden.contiguous()
    rows = hidden.shape[0]
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size: must be in [1, {padded}] (the weight's rows), got {vocab_size}"
        )
    if targets.device != device or targets.shape != (rows,):
        raise ValueError(
            f"targets: expected shape ({rows},) on {device}, got "
            f"{tuple(targets.shape)} on {targets.device}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets: dtype {targets.dtype} is not int32 or int64")
    targets = targets.contiguous()
    if bias is not None:
        if (
            bias.device != device
            or bias.dtype != torch.float32
            or bias.shape != (padded,)
            or not bias.is_contiguous()
        ):
            raise ValueError(
                f"bias: expected a contiguous float32 ({padded},) "
                f"tensor on {device}, got {bias.dtype} "
                f"{tuple(bias.shape)} on {bias.device}"
            )
    if isinstance(temperature, torch.Tensor):
        temps = temperature.to(device=device, dtype=torch.float32)
        if temps.dim() == 0:
            temps = temps.expand(rows)
        if temps.shape != (rows,):
            raise ValueError(
                f"temperature: expected a scalar or shape ({rows},), got {tuple(temps.shape)}"
            )
        temps = temps.contiguous()
    else:
        value = float(temperature)
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"temperature: {value} is not finite and positive")
        temps = value
    return hidden, weight, targets, bias, temps, vocab_size


# ------------------------------------------------------------------ ops
def linear_logp(
    hidden,
    weight,
    targets,
    bias=None,
    temperature=1.0,
    vocab_size=None,
    return_lse=False,
    return_entropy=False,
    *,
    num_threads=0,
    device=None,
):
    """log p(targets[r]) under softmax((hidden[r] . W^T + bias) / temperature)
    over the first vocab_size rows of W: the served bits for the same weights
    and rows (the CPU server's for host arrays, the CUDA server's for CUDA
    arrays or device="cuda").

    hidden [N, H] and weight [V_pad, H]: on the CPU float32 (rounded to bf16,
    nearest even, as the server rounds fp32 input), ml_dtypes.bfloat16, uint16
    bf16 bits, or CPU torch tensors; on CUDA torch (or DLPack, e.g. cupy)
    tensors, the weight bfloat16 (read in place, never copied), hidden
    bfloat16 or float32. bias: [V_pad] float32 or None. temperature: a scalar
    or one per row, finite and > 0. vocab_size: the real vocabulary (rows
    beyond it are padding), default all rows. num_threads (CPU): 0 = all
    cores (bits never depend on it).

    Returns float32 logprobs [N]; with return_lse and/or return_entropy a
    tuple (logprobs, lse, entropy) holding those asked for, in that order
    (entropy = -sum p log p of the row's distribution). CUDA results are torch
    tensors (or the input's framework through DLPack) on the current stream,
    not synchronized; on CUDA a target outside [0, vocab_size) is an error
    (checked with one device-to-host sync; detlogp.torch skips it and gives
    NaN).
    """
    named = {"hidden": hidden, "weight": weight, "targets": targets, "bias": bias}
    if np.ndim(temperature) if not hasattr(temperature, "__dlpack_device__") else True:
        named["temperature"] = temperature  # an array, not a scalar
    if _wants_cuda(device, named):
        return _linear_logp_cuda(
            hidden, weight, targets, bias, temperature, vocab_size, return_lse, return_entropy
        )
    weight_bits, bias32, padded, hidden_size, vocab_size = _head(weight, bias, vocab_size)
    hidden_bits = _bf16_bits(hidden, "hidden")
    if hidden_bits.ndim != 2 or hidden_bits.shape[1] != hidden_size:
        raise ValueError(
            f"hidden: expected [N, {hidden_size}] (the weight's H), got shape {hidden_bits.shape}"
        )
    rows = hidden_bits.shape[0]
    targets_host = _host(targets)
    if targets_host.shape != (rows,):
        raise ValueError(f"targets: expected shape ({rows},), got {targets_host.shape}")
    if not np.issubdtype(targets_host.dtype, np.integer):
        raise TypeError(f"targets: dtype {targets_host.dtype} is not an integer type")
    bad = np.flatnonzero((targets_host < 0) | (targets_host >= vocab_size))
    if bad.size:
        raise ValueError(
            f"detlogp.ops.linear_logp: targets[{bad[0]}] = "
            f"{targets_host[bad[0]]} is outside [0, {vocab_size})"
        )
    targets32 = np.ascontiguousarray(targets_host, dtype=np.int32)
    temps = np.asarray(_host(temperature), dtype=np.float32)
    if temps.ndim == 0:
        temps = np.full(rows, temps, dtype=np.float32)
    elif temps.shape != (rows,):
        raise ValueError(f"temperature: expected a scalar or shape ({rows},), got {temps.shape}")
    temps = np.ascontiguousarray(temps)
    logprobs = np.empty(rows, dtype=np.float32)
    lse = np.empty(rows, dtype=np.float32)
    entropy = np.empty(rows, dtype=np.float32) if return_entropy else None
    if rows:
        lib = load_library()
        error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
        rc = lib.detlogp_cpu_linear_logp(
            _ptr(weight_bits, UINT16_POINTER),
            padded,
            hidden_size,
            _ptr(bias32, FLOAT_POINTER),
            vocab_size,
            _ptr(hidden_bits, UINT16_POINTER),
            rows,
            _ptr(targets32, INT32_POINTER),
            _ptr(temps, FLOAT_POINTER),
            int(num_threads),
            _ptr(logprobs, FLOAT_POINTER),
            _ptr(lse, FLOAT_POINTER),
            _ptr(entropy, FLOAT_POINTER),
            error,
            ERROR_BUFFER_BYTES,
        )
        _raise(rc, error, "linear_logp")
    return pack_outputs(logprobs, lse, entropy, return_lse, return_entropy)


def pack_outputs(logprobs, lse, entropy, return_lse, return_entropy):
    """linear_logp's return value: logprobs alone, or a tuple with lse and
    entropy as asked (detlogp.torch returns the same shapes)."""
    if not (return_lse or return_entropy):
        return logprobs
    return tuple([logprobs] + ([lse] if return_lse else []) + ([entropy] if return_entropy else []))


def _linear_logp_cuda(
    hidden, weight, targets, bias, temperature, vocab_size, return_lse, return_entropy
):
    torch = _torch()
    template = hidden
    hidden_t, weight_t = _as_torch(hidden, "hidden"), _as_torch(weight, "weight")
    targets_t, bias_t = _as_torch(targets, "targets"), _as_torch(bias, "bias")
    if not (isinstance(temperature, (int, float)) or isinstance(temperature, torch.Tensor)):
        temperature = _as_torch(temperature, "temperature")
    if weight_t.dtype == torch.int16 or weight_t.dtype == torch.uint16:
        weight_t = weight_t.view(torch.bfloat16)  # bf16 bits (e.g. cupy uint16)
    if hidden_t.dtype in (torch.int16, torch.uint16):
        hidden_t = hidden_t.view(torch.bfloat16)
    ok, why = cuda_available(weight_t.device.index or 0)
    if not ok:
        raise RuntimeError(why)
    hidden_t, weight_t, targets_t, bias_t, temps, vocab = _cuda_prepare_linear_logp(
        hidden_t, weight_t, targets_t, bias_t, temperature, vocab_size
    )
    if targets_t.numel():
        bad = torch.nonzero((targets_t < 0) | (targets_t >= vocab))
        if bad.numel():
            index = int(bad[0, 0])
            raise ValueError(
                f"detlogp.ops.linear_logp: targets[{index}] = "
                f"{int(targets_t[index])} is outside [0, {vocab})"
            )
    logprobs, lse, entropy = cuda_linear_logp(
        hidden_t, weight_t, targets_t, temps, bias_t, vocab, return_entropy
    )
    return pack_outputs(
        *(_like_input(t, template) for t in (logprobs, lse, entropy)), return_lse, return_entropy
    )


def h3_projection(x, weight, bias=None, *, num_threads=0, device=None):
    """Y [R, 5376] = x [R, 96] . weight^T + bias in float32 with the fixed
    per-output fma order (kernels/projection.h): the server's Project bits,
    equal on the CPU (numpy / CPU tensors) and on CUDA (torch or DLPack CUDA
    tensors, current stream). weight: [5376, 96] float32; bias: [5376]
    float32 or None."""
    if _wants_cuda(device, {"x": x, "weight": weight, "bias": bias}):
        torch = _torch()
        x_t, w_t, b_t = (_as_torch(a, n) for a, n in ((x, "x"), (weight, "weight"), (bias, "bias")))
        ok, why = cuda_available(w_t.device.index or 0)
        if not ok:
            raise RuntimeError(why)
        _check_projection_tensors(torch, x_t, w_t, b_t)
        with torch.cuda.device(w_t.device):
            return _like_input(cuda_h3_projection(x_t, w_t, b_t), x)
    x32 = _float32(x, "x")
    if x32.ndim != 2 or x32.shape[1] != H3_IN_DIM:
        raise ValueError(f"x: expected [R, {H3_IN_DIM}], got shape {x32.shape}")
    w32 = _float32(weight, "weight")
    if w32.shape != (H3_OUT_DIM, H3_IN_DIM):
        raise ValueError(f"weight: expected shape ({H3_OUT_DIM}, {H3_IN_DIM}), got {w32.shape}")
    b32 = None
    if bias is not None:
        b32 = _float32(bias, "bias")
        if b32.shape != (H3_OUT_DIM,):
            raise ValueError(f"bias: expected shape ({H3_OUT_DIM},), got {b32.shape}")
    rows = x32.shape[0]
    y = np.empty((rows, H3_OUT_DIM), dtype=np.float32)
    lib = load_library()
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    rc = lib.detlogp_cpu_h3_projection(
        _ptr(x32, FLOAT_POINTER),
        rows,
        _ptr(w32, FLOAT_POINTER),
        _ptr(b32, FLOAT_POINTER),
        int(num_threads),
        _ptr(y, FLOAT_POINTER),
        error,
        ERROR_BUFFER_BYTES,
    )
    _raise(rc, error, "h3_projection")
    return y


def _check_projection_tensors(torch, x, weight, bias):
    """Shapes, dtypes (float32), devices and contiguity of the projection's
    CUDA tensors; the messages name the argument."""
    device = weight.device
    for name, tensor, shape in (
        ("x", x, None),
        ("weight", weight, (H3_OUT_DIM, H3_IN_DIM)),
        ("bias", bias, (H3_OUT_DIM,)),
    ):
        if tensor is None:
            continue
        if tensor.dtype != torch.float32:
            raise TypeError(f"{name}: dtype {tensor.dtype} is not float32")
        if tensor.device != device:
            raise ValueError(f"{name}: on {tensor.device}, weight on {device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: not contiguous (no hidden copies are made)")
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
    if x.dim() != 2 or x.shape[1] != H3_IN_DIM:
        raise ValueError(f"x: expected [R, {H3_IN_DIM}], got shape {tuple(x.shape)}")


def determinism_key(weight, bias=None, vocab_size=None, *, device=None):
    """The determinism key the server reports (ModelInfo.determinism_key) when
    it serves these weights on `device`: "cpu" (default for host arrays),
    "cuda:N" (the kernel GPU N runs: the Hopper kernel on compute capability
    9.0, else the portable kernel, whose key names the GPU's compute
    capability and loaded code; needs the GPU; the default for CUDA arrays,
    with their GPU) or "cuda" (the Hopper kernel's key, sm_90a, which needs no
    GPU to compute). weight [V_pad, H] (float32
    rounded to bf16, or bf16 / bf16 bits; CUDA tensors are copied to the host
    once to hash them), bias [V_pad] float32 or None, vocab_size (default all
    rows)."""
    cuda = (
        _wants_cuda(device, {"weight": weight, "bias": bias})
        if device is None
        else str(device).split(":")[0].lower() == "cuda"
    )
    if device is not None and str(device).split(":")[0].lower() not in ("cpu", "cuda"):
        raise ValueError(f"detlogp.ops: device {device!r} is neither 'cpu' nor 'cuda'")
    gpu = None  # the GPU whose kernel the key is for; None: the Hopper kernel
    if cuda and device is not None and ":" in str(device):
        gpu = int(str(device).split(":")[1])
    elif cuda and device is None:
        gpu = getattr(getattr(weight, "device", None), "index", None)
        gpu = 0 if gpu is None else gpu
    weight_bits, bias32, padded, hidden_size, vocab_size = _head(weight, bias, vocab_size)
    lib = load_cuda_library() if cuda else load_library()
    key = ctypes.create_string_buffer(_KEY_LEN)
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    args = (
        _ptr(weight_bits, UINT16_POINTER),
        padded,
        hidden_size,
        _ptr(bias32, FLOAT_POINTER),
        vocab_size,
        key,
        _KEY_LEN,
        error,
        ERROR_BUFFER_BYTES,
    )
    if gpu is not None:
        rc = lib.detlogp_cuda_device_determinism_key(gpu, *args)
    elif cuda:
        rc = lib.detlogp_cuda_determinism_key(*args)
    else:
        rc = lib.detlogp_cpu_determinism_key(*args)
    _raise(rc, error, "determinism_key")
    return key.value.decode()
