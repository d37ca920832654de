"""The trainer's twin: the served kernels as PyTorch ops with autograd.

    linear_logp(hidden, weight, targets, bias=None, temperature=1.0,
                vocab_size=None, return_lse=False, return_entropy=False)
    h3_projection(x, weight, bias=None)

are `torch.library` custom ops (detlogp::linear_logp, detlogp::h3_projection)
with fake (meta) implementations and autograd through `register_autograd`;
their backwards are custom ops too (detlogp::linear_logp_backward_fused and
detlogp::linear_logp_backward_chunked, detlogp::h3_projection_input_grad and
detlogp::h3_projection_weight_grad). Tracing never reaches a kernel, so
torch.compile(fullgraph=True) of a forward and backward gives the eager
op's bits; on CUDA every op takes outputs and workspace from PyTorch's
caching allocator, launches on the current stream and never synchronizes
or reads device values on the host, so CUDA graphs (torch.cuda.graph,
torch.compile(mode="reduce-overhead")) capture and replay them. Forward
bits are the server's: on CUDA tensors the kernels the CUDA server runs on
that GPU (the weight read in place), on CPU tensors the CPU kernels (the
CPU server's bits).

Dtypes:
  * CUDA: weight bfloat16 (never copied: convert it once, outside the loop),
    hidden bfloat16 or float32 (float32 is rounded to bf16 as the server
    rounds fp32 input: a copy of hidden, not of the weight), bias float32.
  * CPU: bfloat16 or float32 (rounded to bf16 as on CUDA) through the CPU
    library; or float64 for every floating input, which selects a float64
    reference (chunked log-softmax in float64, no bf16 rounding): not the
    served bits, but what `torch.autograd.gradcheck` needs to check the
    backward. Results are float32, or float64 on the float64 path.

linear_logp's backward:
  * on a GPU with the Hopper kernel (compute capability 9.0), the fused,
    batch-invariant kernel sm90a-wgmma-bwd-v1 (docs/kernels.md,
    ops.cuda_linear_logp_backward): the logits recomputed tile by tile from
    the saved lse (never [N, V]), bf16 operands with float32 accumulation; a
    row's d hidden bits depend only on that row, d weight and d bias are the
    same bits run to run; extra memory <= 384 MiB at N = 16384;
  * elsewhere (CPU tensors, the float64 path, GPUs without it) the chunked
    backward: the logits recomputed from the saved lse in tiles of rows x
    vocabulary (float32 arithmetic on the bf16-rounded inputs with TF32 off;
    float64 on the float64 path), two passes (one for d hidden, one for d
    weight and d bias, each accumulating in float32 over one tile
    dimension), extra memory under BACKWARD_BUDGET_BYTES (default 512 MiB)
    at any N.
Both are deterministic; which one runs depends on the device alone
(compute capability 9.0 or not), so compiled and eager code run the same.
Gradients flow from logprobs, lse and entropy;
float32 hidden/weight get the gradient of the rounded values (straight
through the bf16 rounding). A row whose target is outside [0, vocab_size)
(NaN log-prob) gets the gradient of its lse term only.

h3_projection's backward is the batch-invariant dX and dW/dbias kernels
(kernels/cuda/projection_cuda.h on CUDA, kernels/projection_grad.h on the
CPU; equal bits), rows keyed 0..R-1 in batch order.
"""

import contextlib
import functools
import math
from typing import Optional, Tuple

import numpy as np
import torch

from detlogp import ops

__all__ = ["linear_logp", "h3_projection", "BACKWARD_BUDGET_BYTES"]

# Extra memory the chunked linear-logp backward may use (tiles and their
# float32 accumulators), in bytes.
BACKWARD_BUDGET_BYTES = 512 << 20

_FLOAT64 = torch.float64


# ------------------------------------------------------------------ helpers
def _bf16_bits_numpy(tensor):
    """A CPU tensor's values as bf16 bits (uint16 numpy, no copy for bf16)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.detach().contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.detach().contiguous().numpy()  # float32: rounded by ops


def _rounded(tensor):
    """The values the kernels see: bf16-rounded, widened to float32 (float64
    tensors stay as they are: the reference path)."""
    if tensor.dtype == _FLOAT64:
        return tensor
    return tensor.to(torch.bfloat16).to(torch.float32)


@contextlib.contextmanager
def _ieee_fp32_matmul(device):
    """float32 matmuls in full float32 (no TF32) inside the block."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = saved


def _check_linear_logp(hidden, weight, targets, bias, temperature, vocab_size):
    """Inputs checked in one place; messages name the argument. temperature:
    a [N] tensor, or None (one value for every row, passed as a float)."""
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("hidden and weight must be torch tensors (detlogp.ops takes numpy arrays)")
    device = weight.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"weight: on {device}; only CPU and CUDA are supported")
    for name, tensor in (
        ("hidden", hidden),
        ("targets", targets),
        ("bias", bias),
        ("temperature", temperature),
    ):
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"{name}: on {tensor.device}, weight on {device} (no hidden copies are made)"
            )
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [V_pad, H], got shape {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError(
            "weight: not contiguous (it is never copied; pass a contiguous [V_pad, H] tensor)"
        )
    padded, hidden_size = weight.shape
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(
            f"hidden: expected [N, {hidden_size}] (the weight's H), got shape {tuple(hidden.shape)}"
        )
    float64 = weight.dtype == _FLOAT64
    allowed = (
        (_FLOAT64,)
        if float64
        else (torch.bfloat16,)
        if device.type == "cuda"
        else (torch.bfloat16, torch.float32)
    )
    if weight.dtype not in allowed:
        raise TypeError(
            f"weight: dtype {weight.dtype}; expected one of {allowed} "
            f"on {device.type} (float64 everywhere selects the CPU "
            "float64 reference)"
        )
    hidden_allowed = (_FLOAT64,) if float64 else (torch.bfloat16, torch.float32)
    if hidden.dtype not in hidden_allowed:
        raise TypeError(
            f"hidden: dtype {hidden.dtype}; expected one of {hidden_allowed}"
            f" with a {weight.dtype} weight"
        )
    if float64 and device.type != "cpu":
        raise TypeError("float64 inputs select the CPU reference path: CPU tensors only")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"targets: expected shape ({hidden.shape[0]},), got {tuple(targets.shape)}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets: dtype {targets.dtype} is not int32 or int64")
    if bias is not None:
        want = _FLOAT64 if float64 else torch.float32
        if bias.dtype != want or tuple(bias.shape) != (padded,):
            raise ValueError(
                f"bias: expected {want} of shape ({padded},), got {bias.dtype} {tuple(bias.shape)}"
            )
        if not bias.is_contiguous():
            raise ValueError("bias: not contiguous (it is read in place, never copied)")
    if temperature is not None and (
        temperature.dim() != 1 or temperature.shape[0] != hidden.shape[0]
    ):
        raise ValueError(
            f"temperature: expected shape ({hidden.shape[0]},), got {tuple(temperature.shape)}"
        )
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size: must be in [1, {padded}] (the weight's rows), got {vocab_size}"
        )


def _out_dtype(weight):
    return _FLOAT64 if weight.dtype == _FLOAT64 else torch.float32


def _temperatures(temperature, value, rows, dtype, device):
    """The per-row temperatures as a [rows] tensor (the CPU, float64 and
    backward paths; the CUDA forward takes the scalar as it is)."""
    if temperature is not None:
        return temperature.to(dtype)
    return torch.full((rows,), value, dtype=dtype, device=device)


# ------------------------------------------------------------------ linear_logp
# temperature: [N] per-row temperatures, or None: every row's is
# temperature_value (so the common scalar case fills no [N] tensor on the GPU).
@torch.library.custom_op("detlogp::linear_logp", mutates_args=())
def _linear_logp_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor],
    temperature_value: float,
    vocab_size: int,
    return_entropy: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_linear_logp(hidden, weight, targets, bias, temperature, vocab_size)
    rows = hidden.shape[0]
    if weight.device.type == "cuda":
        # Checked above; what the kernel reads in place stays as it is (bf16
        # hidden, int32/int64 targets, float32 temperatures, all contiguous
        # in the usual call): the forward launches the library's two kernels
        # and nothing else.
        if hidden.dtype != torch.bfloat16:
            hidden = hidden.to(torch.bfloat16)  # fp32 rounded as the server does
        temps = (
            temperature_value if temperature is None else temperature.to(torch.float32).contiguous()
        )
        logp, lse, entropy = ops.cuda_linear_logp(
            hidden.contiguous(),
            weight,
            targets.contiguous(),
            temps,
            bias,
            vocab_size,
            return_entropy,
        )
        if entropy is None:
            entropy = logp.new_empty((0,))
        return logp, lse, entropy
    temperature = _temperatures(
        temperature, temperature_value, rows, _out_dtype(weight), weight.device
    )
    if weight.dtype == _FLOAT64:
        return _reference_linear_logp(
            hidden, weight, targets, bias, temperature, vocab_size, return_entropy
        )
    # CPU kernels through the CPU library; invalid targets give NaN as on CUDA.
    valid = (targets >= 0) & (targets < vocab_size)
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    out = ops.linear_logp(
        _bf16_bits_numpy(hidden),
        _bf16_bits_numpy(weight),
        safe_targets.detach().numpy(),
        None if bias is None else bias.detach().contiguous().numpy(),
        temperature.detach().to(torch.float32).contiguous().numpy(),
        vocab_size=vocab_size,
        return_lse=True,
        return_entropy=return_entropy,
    )
    logp = torch.from_numpy(out[0])
    logp = torch.where(valid, logp, torch.full_like(logp, float("nan")))
    lse = torch.from_numpy(out[1])
    entropy = torch.from_numpy(out[2]) if return_entropy else logp.new_empty((0,))
    del rows
    return logp, lse, entropy


@_linear_logp_op.register_fake
def _(hidden, weight, targets, bias, temperature, temperature_value, vocab_size, return_entropy):
    rows = hidden.shape[0]
    dtype = _out_dtype(weight)
    return (
        hidden.new_empty((rows,), dtype=dtype),
        hidden.new_empty((rows,), dtype=dtype),
        hidden.new_empty((rows if return_entropy else 0,), dtype=dtype),
    )


def _row_chunk(rows, hidden_size, vocab, budget_bytes):
    """Tile edge C (rows and vocabulary) so that the tiles and accumulators of
    one step fit the budget: ~ 4 bytes x (3 H C + 6 C^2) (the caller halves
    the budget for float64)."""
    budget = max(int(budget_bytes), 1 << 12)
    c = (-3 * hidden_size + math.sqrt(9 * hidden_size**2 + 24 * budget / 4.0)) / 12
    return max(1, min(int(c), 8192))


def _reference_linear_logp(hidden, weight, targets, bias, temperature, vocab_size, return_entropy):
    """float64 forward (the gradcheck path): chunked over rows."""
    rows = hidden.shape[0]
    logp = hidden.new_empty((rows,))
    lse = hidden.new_empty((rows,))
    entropy = hidden.new_empty((rows if return_entropy else 0,))
    w = weight[:vocab_size]
    chunk = _row_chunk(rows, weight.shape[1], vocab_size, BACKWARD_BUDGET_BYTES)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        z = hidden[r0:r1] @ w.T
        if bias is not None:
            z = z + bias[:vocab_size]
        z = z / temperature[r0:r1, None]
        row_lse = torch.logsumexp(z, dim=1)
        lse[r0:r1] = row_lse
        t = targets[r0:r1].long()
        valid = (t >= 0) & (t < vocab_size)
        picked = z.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
        logp[r0:r1] = torch.where(valid, picked - row_lse, torch.full_like(row_lse, float("nan")))
        if return_entropy:
            logq = z - row_lse[:, None]
            entropy[r0:r1] = -(logq.exp() * logq).sum(dim=1)
    return logp, lse, entropy


def _tile_grad(h, w, b, temps, lse, targets, g_logp, g_lse, g_ent, ent, v0):
    """d loss / d (h . w^T + b) for one tile of rows x vocabulary [v0, v0 +
    len(w)), from the saved lse: float32 (float64 on the reference path)."""
    z = h @ w.T
    if b is not None:
        z = z + b
    z = z / temps[:, None]
    logq = z - lse[:, None]
    p = logq.exp()
    coef = g_lse - g_logp  # d/dz of lse and of -lse in logp
    g = p * coef[:, None]
    if g_ent is not None:
        # entropy = -sum p log p: d/dz_v = -p_v (log p_v + entropy)
        g = g - g_ent[:, None] * p * (logq + ent[:, None])
    # + g_logp at the target's column, for rows whose target is in the tile
    # (no host sync: rows outside add 0 at column 0).
    local = targets.long() - v0
    inside = (local >= 0) & (local < w.shape[0])
    g.scatter_add_(
        1, torch.where(inside, local, 0)[:, None], torch.where(inside, g_logp, 0)[:, None]
    )
    return g / temps[:, None]


def _linear_logp_backward_impl(
    hidden,
    weight,
    targets,
    bias,
    temperature,
    vocab_size,
    lse,
    entropy,
    g_logp,
    g_lse,
    g_ent,
    need_hidden,
    need_weight,
    need_bias,
    budget_bytes,
):
    float64 = weight.dtype == _FLOAT64
    acc_dtype = _FLOAT64 if float64 else torch.float32
    rows, hidden_size = hidden.shape
    padded = weight.shape[0]
    device = weight.device
    # Rows whose target is invalid have NaN forward values; their
    # gradients are NaN too (as the forward), never silently zero.
    g_logp = (
        torch.zeros(rows, dtype=acc_dtype, device=device)
        if g_logp is None
        else g_logp.to(acc_dtype)
    )
    g_lse = (
        torch.zeros(rows, dtype=acc_dtype, device=device) if g_lse is None else g_lse.to(acc_dtype)
    )
    if g_ent is not None:
        g_ent = g_ent.to(acc_dtype)
        entropy = entropy.to(acc_dtype)
    temps = temperature.to(acc_dtype)
    lse = lse.to(acc_dtype)
    chunk = _row_chunk(rows, hidden_size, vocab_size, budget_bytes / (2 if float64 else 1))
    d_hidden = d_weight = d_bias = None

    def bias_tile(v0, v1):
        return None if bias is None else bias[v0:v1].to(acc_dtype)

    with _ieee_fp32_matmul(device):
        if need_hidden:
            d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device)
            for r0 in range(0, rows, chunk):
                r1 = min(rows, r0 + chunk)
                h = _rounded(hidden[r0:r1])
                acc = torch.zeros((r1 - r0, hidden_size), dtype=acc_dtype, device=device)
                for v0 in range(0, vocab_size, chunk):
                    v1 = min(vocab_size, v0 + chunk)
                    w = _rounded(weight[v0:v1])
                    g = _tile_grad(
                        h,
                        w,
                        bias_tile(v0, v1),
                        temps[r0:r1],
                        lse[r0:r1],
                        targets[r0:r1],
                        g_logp[r0:r1],
                        g_lse[r0:r1],
                        None if g_ent is None else g_ent[r0:r1],
                        None if g_ent is None else entropy[r0:r1],
                        v0,
                    )
                    acc.addmm_(g, w)
                d_hidden[r0:r1] = acc.to(hidden.dtype)
        if need_weight or need_bias:
            if need_weight:
                d_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=device)
            if need_bias:
                d_bias = torch.zeros((padded,), dtype=bias.dtype, device=device)
            for v0 in range(0, vocab_size, chunk):
                v1 = min(vocab_size, v0 + chunk)
                w = _rounded(weight[v0:v1])
                acc_w = (
                    torch.zeros((v1 - v0, hidden_size), dtype=acc_dtype, device=device)
                    if need_weight
                    else None
                )
                acc_b = (
                    torch.zeros((v1 - v0,), dtype=acc_dtype, device=device) if need_bias else None
                )
                for r0 in range(0, rows, chunk):
                    r1 = min(rows, r0 + chunk)
                    h = _rounded(hidden[r0:r1])
                    g = _tile_grad(
                        h,
                        w,
                        bias_tile(v0, v1),
                        temps[r0:r1],
                        lse[r0:r1],
                        targets[r0:r1],
                        g_logp[r0:r1],
                        g_lse[r0:r1],
                        None if g_ent is None else g_ent[r0:r1],
                        None if g_ent is None else entropy[r0:r1],
                        v0,
                    )
                    if acc_w is not None:
                        acc_w.addmm_(g.T, h)
                    if acc_b is not None:
                        acc_b += g.sum(dim=0)
                if need_weight:
                    d_weight[v0:v1] = acc_w.to(weight.dtype)
                if need_bias:
                    d_bias[v0:v1] = acc_b.to(bias.dtype)
    return d_hidden, d_weight, d_bias


def _setup_linear_logp(ctx, inputs, output):
    (hidden, weight, targets, bias, temperature, temperature_value, vocab_size, return_entropy) = (
        inputs
    )
    _, lse, entropy = output
    ctx.save_for_backward(hidden, weight, targets, bias, temperature, lse, entropy)
    ctx.temperature_value = temperature_value
    ctx.vocab_size = vocab_size
    ctx.return_entropy = return_entropy


def _unasked(tensor, dtype=None):
    """The placeholder a backward op returns for a gradient nobody asked for
    (custom ops return tensors, never None): empty, on tensor's device."""
    return tensor.new_empty((0,), dtype=dtype)


def _backward_outputs(hidden, weight, bias, need_hidden, need_weight, need_bias, like):
    """(d hidden, d weight, d bias) shaped as the backward ops return them:
    `like(tensor, shape)` for those asked for, else an empty placeholder."""
    bias_dtype = _out_dtype(weight) if bias is None else bias.dtype
    return (
        like(hidden, hidden.shape) if need_hidden else _unasked(hidden),
        like(weight, weight.shape) if need_weight else _unasked(weight),
        like(bias, bias.shape) if need_bias else _unasked(weight, bias_dtype),
    )


# The two backwards, each an opaque custom op (torch.compile and CUDA graphs
# see one call; tracing never reaches a kernel's raw pointers). Arguments:
# the forward's inputs as saved, its lse and entropy, the upstream gradients
# (None: zero) and which gradients to compute. Returns (d hidden, d weight,
# d bias) in the inputs' dtypes; one not asked for is an empty tensor.
@torch.library.custom_op("detlogp::linear_logp_backward_chunked", mutates_args=())
def _chunked_backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor],
    temperature_value: float,
    vocab_size: int,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: Optional[torch.Tensor],
    grad_lse: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    temperature = _temperatures(
        temperature, temperature_value, hidden.shape[0], lse.dtype, lse.device
    )
    need_bias = need_bias and bias is not None
    d_hidden, d_weight, d_bias = _linear_logp_backward_impl(
        hidden,
        weight,
        targets,
        bias,
        temperature,
        vocab_size,
        lse,
        entropy,
        grad_logprobs,
        grad_lse,
        grad_entropy,
        need_hidden,
        need_weight,
        need_bias,
        BACKWARD_BUDGET_BYTES,
    )
    placeholders = _backward_outputs(hidden, weight, bias, False, False, False, None)
    return tuple(p if g is None else g for g, p in zip((d_hidden, d_weight, d_bias), placeholders))


@torch.library.custom_op("detlogp::linear_logp_backward_fused", mutates_args=())
def _fused_backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor],
    temperature_value: float,
    vocab_size: int,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: Optional[torch.Tensor],
    grad_lse: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused Hopper backward (ops.cuda_linear_logp_backward): outputs and
    workspace from PyTorch's caching allocator, launched on the current
    stream, no synchronisation."""
    if weight.device.type != "cuda" or not _fused_backward_on(weight.device):
        raise ValueError(
            f"weight: on {weight.device}; the fused linear-logp backward runs on a "
            "GPU of compute capability 9.0 (detlogp::linear_logp_backward_chunked "
            "runs elsewhere)"
        )
    need_bias = need_bias and bias is not None

    def upstream(grad):
        return None if grad is None else grad.to(torch.float32).contiguous()

    temps = temperature_value if temperature is None else temperature.to(torch.float32).contiguous()
    with torch.cuda.device(weight.device):
        d_hidden, d_weight, d_bias = ops.cuda_linear_logp_backward(
            hidden.to(torch.bfloat16).contiguous(),
            weight,
            targets.contiguous(),
            lse,
            temperatures=temps,
            bias=bias,
            vocab_size=vocab_size,
            entropy=None if grad_entropy is None else entropy,
            grad_logprobs=upstream(grad_logprobs),
            grad_lse=upstream(grad_lse),
            grad_entropy=upstream(grad_entropy),
            need_hidden=need_hidden,
            need_weight=need_weight,
            need_bias=need_bias,
            hidden_grad_dtype=hidden.dtype,
            weight_grad_dtype=weight.dtype,
        )
    placeholders = _backward_outputs(hidden, weight, bias, False, False, False, None)
    return tuple(p if g is None else g for g, p in zip((d_hidden, d_weight, d_bias), placeholders))


def _backward_fake(
    hidden,
    weight,
    targets,
    bias,
    temperature,
    temperature_value,
    vocab_size,
    lse,
    entropy,
    grad_logprobs,
    grad_lse,
    grad_entropy,
    need_hidden,
    need_weight,
    need_bias,
):
    return _backward_outputs(
        hidden,
        weight,
        bias,
        need_hidden,
        need_weight,
        need_bias and bias is not None,
        lambda tensor, shape: tensor.new_empty(shape),
    )


_chunked_backward_op.register_fake(_backward_fake)
_fused_backward_op.register_fake(_backward_fake)


@functools.cache
def _fused_backward_on_index(index):
    return torch.cuda.get_device_capability(index) == (9, 0)


def _fused_backward_on(device):
    """Whether the fused backward runs on `device`: a GPU of compute
    capability 9.0, where the forward runs the Hopper kernel (the same rule
    as the C library's). Decided from the device alone, so that tracing with
    fake tensors picks the op eager mode runs."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _fused_backward_on_index(index)


def _backward_linear_logp(ctx, g_logp, g_lse, g_ent):
    hidden, weight, targets, bias, temperature, lse, entropy = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_bias = bias is not None and need[3]
    backward = _fused_backward_op if _fused_backward_on(weight.device) else _chunked_backward_op
    d_hidden, d_weight, d_bias = backward(
        hidden,
        weight,
        targets,
        bias,
        temperature,
        ctx.temperature_value,
        ctx.vocab_size,
        lse,
        entropy,
        g_logp,
        g_lse,
        g_ent if ctx.return_entropy else None,
        need[0],
        need[1],
        need_bias,
    )
    return (
        d_hidden if need[0] else None,
        d_weight if need[1] else None,
        None,
        d_bias if need_bias else None,
        None,
        None,
        None,
        None,
    )


_linear_logp_op.register_autograd(_backward_linear_logp, setup_context=_setup_linear_logp)


def linear_logp(
    hidden,
    weight,
    targets,
    bias=None,
    temperature=1.0,
    vocab_size=None,
    return_lse=False,
    return_entropy=False,
):
    """log p(targets[r]) under softmax((hidden[r] . W^T + bias) / temperature)
    over the first vocab_size rows of W, with the server's bits (see the
    module docstring for devices and dtypes) and autograd for hidden, weight
    and bias. temperature: a float or a [N] tensor. Returns logprobs [N], or
    a tuple (logprobs, lse, entropy) of those asked for, in that order."""
    if not isinstance(targets, torch.Tensor):
        targets = torch.as_tensor(np.asarray(targets), device=weight.device)
    out_dtype = _out_dtype(weight)
    value = 1.0
    if isinstance(temperature, torch.Tensor):
        temps = temperature.to(dtype=out_dtype)
        if temps.dim() == 0:
            temps = temps.expand(hidden.shape[0])
        temps = temps.contiguous()
    else:
        # One value for every row: passed as a float, no [N] tensor filled.
        value = float(temperature)
        # Comparisons, not math.isfinite: torch.compile traces a float
        # argument as a symbolic float, which math.isfinite cannot take.
        if not (0 < value < math.inf):
            raise ValueError(f"temperature: {value} is not finite and positive")
        temps = None
    vocab = weight.shape[0] if vocab_size is None else int(vocab_size)
    logp, lse, entropy = _linear_logp_op(
        hidden, weight, targets, bias, temps, value, vocab, bool(return_entropy)
    )
    return ops.pack_outputs(logp, lse, entropy, return_lse, return_entropy)


# ------------------------------------------------------------------ H3 projection
def _check_projection(x, weight, bias):
    device = weight.device
    float64 = weight.dtype == _FLOAT64
    want = _FLOAT64 if float64 else torch.float32
    if float64 and device.type != "cpu":
        raise TypeError("float64 inputs select the CPU reference path: CPU tensors only")
    for name, tensor, shape in (
        ("x", x, None),
        ("weight", weight, (ops.H3_OUT_DIM, ops.H3_IN_DIM)),
        ("bias", bias, (ops.H3_OUT_DIM,)),
    ):
        if tensor is None:
            continue
        if tensor.dtype != want:
            raise TypeError(f"{name}: dtype {tensor.dtype}, expected {want}")
        if tensor.device != device:
            raise ValueError(f"{name}: on {tensor.device}, weight on {device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: not contiguous (no hidden copies are made)")
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
    if x.dim() != 2 or x.shape[1] != ops.H3_IN_DIM:
        raise ValueError(f"x: expected [R, {ops.H3_IN_DIM}], got {tuple(x.shape)}")


@torch.library.custom_op("detlogp::h3_projection", mutates_args=())
def _h3_projection_op(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    _check_projection(x, weight, bias)
    if weight.device.type == "cuda":
        with torch.cuda.device(weight.device):
            return ops.cuda_h3_projection(x, weight, bias)
    if weight.dtype == _FLOAT64:
        y = x @ weight.T
        return y + bias if bias is not None else y
    return torch.from_numpy(
        ops.h3_projection(
            x.detach().numpy(),
            weight.detach().numpy(),
            None if bias is None else bias.detach().numpy(),
        )
    )


@_h3_projection_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], ops.H3_OUT_DIM))


@torch.library.custom_op("detlogp::h3_projection_input_grad", mutates_args=())
def _h3_input_grad_op(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.device.type == "cuda":
        with torch.cuda.device(weight.device):
            return ops.cuda_h3_projection_input_grad(dy.contiguous(), weight)
    if weight.dtype == _FLOAT64:
        return dy @ weight
    return torch.from_numpy(
        ops.cpu_h3_projection_input_grad(dy.detach().contiguous().numpy(), weight.detach().numpy())
    )


@_h3_input_grad_op.register_fake
def _(dy, weight):
    return dy.new_empty((dy.shape[0], ops.H3_IN_DIM))


@torch.library.custom_op("detlogp::h3_projection_weight_grad", mutates_args=())
def _h3_weight_grad_op(dy: torch.Tensor, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if x.device.type == "cuda":
        with torch.cuda.device(x.device):
            return ops.cuda_h3_projection_weight_grad(dy.contiguous(), x, True)
    if x.dtype == _FLOAT64:
        return dy.T @ x, dy.sum(dim=0)
    dweight, dbias = ops.cpu_h3_projection_weight_grad(
        dy.detach().contiguous().numpy(), x.detach().numpy(), True
    )
    return torch.from_numpy(dweight), torch.from_numpy(dbias)


@_h3_weight_grad_op.register_fake
def _(dy, x):
    return (x.new_empty((ops.H3_OUT_DIM, ops.H3_IN_DIM)), x.new_empty((ops.H3_OUT_DIM,)))


def _setup_projection(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward_projection(ctx, dy):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    dx = _h3_input_grad_op(dy, weight) if need_x else None
    dweight = dbias = None
    if need_w or (need_b and ctx.has_bias):
        dweight, dbias = _h3_weight_grad_op(dy, x)
    return dx, dweight if need_w else None, dbias if (need_b and ctx.has_bias) else None


_h3_projection_op.register_autograd(_backward_projection, setup_context=_setup_projection)


def h3_projection(x, weight, bias=None):
    """Y [R, 5376] = x [R, 96] . weight^T + bias: the server's Project bits
    (equal on CPU and CUDA; float32, or float64 on the CPU reference path),
    with autograd through the batch-invariant dX/dW/dbias kernels."""
    return _h3_projection_op(x, weight, bias)
