"""A float64 numpy reference of the service's math, for tests and checks.

z = (bf16(h) . bf16(W)[v] + b[v]) / temperature over v < vocab_size;
log p(target) = z[target] - logsumexp(z); entropy and top-k on the same z.
Inputs are rounded to bf16 the way the server rounds them (RNE from fp32;
fp16 widened exactly first).
"""

import numpy as np

from detlogp import tensors


def hidden_as_float64(hidden):
    """The float64 values the server computes with for these hidden rows."""
    hidden = np.asarray(hidden)
    if hidden.dtype == np.uint16 or (
        tensors.BFLOAT16 is not None and hidden.dtype == tensors.BFLOAT16
    ):
        bits = hidden.view(np.uint16)
    else:
        bits = tensors.float32_to_bf16_bits(hidden.astype(np.float32))
    return tensors.bf16_bits_to_float32(bits).astype(np.float64)


def logits(hidden, weight_bf16_bits, bias=None, temperature=1.0, vocab_size=None):
    """z float64 [N, vocab] for hidden [N, H], weight bits [V_pad, H]."""
    h = hidden_as_float64(hidden)
    w = tensors.bf16_bits_to_float32(weight_bf16_bits).astype(np.float64)
    vocab = w.shape[0] if vocab_size is None else vocab_size
    z = h @ w[:vocab].T
    if bias is not None:
        z += np.asarray(bias, dtype=np.float64)[:vocab]
    z /= temperature if temperature else 1.0
    return z


def _lse(z):
    peak = z.max(axis=1, keepdims=True)
    return (peak + np.log(np.exp(z - peak).sum(axis=1, keepdims=True)))[:, 0]


def logprobs(hidden, targets, weight_bf16_bits, bias=None, temperature=1.0, vocab_size=None):
    """(logprobs, lse) float64 arrays for hidden [N, H], weight bits [V, H]."""
    z = logits(hidden, weight_bf16_bits, bias, temperature, vocab_size)
    lse = _lse(z)
    targets = np.asarray(targets, dtype=np.int64)
    return z[np.arange(len(targets)), targets] - lse, lse


def entropy_top_k(hidden, weight_bf16_bits, bias=None, temperature=1.0, vocab_size=None, k=0):
    """(entropy [N], top_ids [N, k], top_logprobs [N, k]) in float64:
    entropy = lse - sum_v p_v z_v with p_v = exp(z_v - lse); the k largest
    z_v, ties to the lower id, as z_v - lse."""
    z = logits(hidden, weight_bf16_bits, bias, temperature, vocab_size)
    lse = _lse(z)
    p = np.exp(z - lse[:, None])
    entropy = lse - (p * z).sum(axis=1)
    order = np.argsort(-z, axis=1, kind="stable")[:, :k]  # stable: lower id first
    rows = np.arange(z.shape[0])[:, None]
    return entropy, order, z[rows, order] - lse[:, None]
