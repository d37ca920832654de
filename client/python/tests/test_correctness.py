"""Answers match a float64 numpy reference of the lm_head the test wrote, for
every input dtype; the determinism key and ModelInfo describe that model."""

import numpy as np
import pytest
from detlogp import tensors

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

# fp32 accumulation over H=64 and a 1000-way logsumexp, against float64.
ATOL = 2e-4


def test_info_describes_the_written_model(client, model):
    info = client.info()
    assert (info.hidden_size, info.vocab_size, info.padded_vocab_size) == (
        model.hidden,
        model.vocab,
        model.padded_vocab,
    )
    assert info.has_bias
    assert info.determinism_key
    print(f"info: key={info.determinism_key} backend={info.backend} kernel={info.kernel_version}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bf16_bits", "ml_bfloat16", "float64"])
def test_logprobs_match_float64_reference(client, model, dtype):
    hidden, targets = model.random_rows(16, seed=1)
    if dtype == "float16":
        hidden = hidden.astype(np.float16)
    elif dtype == "bf16_bits":
        hidden = tensors.float32_to_bf16_bits(hidden)
    elif dtype == "ml_bfloat16":
        if ml_dtypes is None:
            pytest.skip("ml_dtypes not installed")
        hidden = hidden.astype(ml_dtypes.bfloat16)
    elif dtype == "float64":
        hidden = hidden.astype(np.float64)
    result = client.logprobs(hidden, targets, return_lse=True)
    want_logp, want_lse = model.reference(hidden, targets)
    assert result.logprobs.dtype == np.float32 and result.logprobs.shape == (16,)
    np.testing.assert_allclose(result.logprobs, want_logp, atol=ATOL, rtol=0)
    np.testing.assert_allclose(result.lse, want_lse, atol=ATOL, rtol=0)
    assert np.all(result.logprobs <= 0)


def test_temperature_scales_logits(client, model):
    hidden, targets = model.random_rows(8, seed=2)
    for temperature in (0.5, 2.0):
        result = client.logprobs(hidden, targets, temperature=temperature, return_lse=True)
        want_logp, want_lse = model.reference(hidden, targets, temperature)
        np.testing.assert_allclose(result.logprobs, want_logp, atol=ATOL, rtol=0)
        np.testing.assert_allclose(result.lse, want_lse, atol=ATOL, rtol=0)


def test_temperature_zero_means_one(client, model):
    hidden, targets = model.random_rows(4, seed=3)
    a = client.logprobs(hidden, targets, temperature=0.0)
    b = client.logprobs(hidden, targets, temperature=1.0)
    assert a.logprobs.tobytes() == b.logprobs.tobytes()


def test_lse_only_when_asked(client, model):
    hidden, targets = model.random_rows(3, seed=4)
    assert client.logprobs(hidden, targets).lse is None


def test_every_dtype_of_the_same_bf16_values_gives_the_same_bits(client, model):
    hidden, targets = model.random_rows(8, seed=5)
    bits = tensors.float32_to_bf16_bits(hidden)
    exact = tensors.bf16_bits_to_float32(bits)  # fp32 values exactly bf16
    a = client.logprobs(bits, targets)
    b = client.logprobs(exact, targets)
    assert a.logprobs.tobytes() == b.logprobs.tobytes()
    assert a.determinism_key == b.determinism_key


def test_padding_rows_are_ignored_and_last_real_target_works(client, model):
    hidden, _ = model.random_rows(2, seed=6)
    targets = np.array([0, model.vocab - 1])
    result = client.logprobs(hidden, targets, return_lse=True)
    want_logp, want_lse = model.reference(hidden, targets)
    np.testing.assert_allclose(result.lse, want_lse, atol=ATOL, rtol=0)
    np.testing.assert_allclose(result.logprobs, want_logp, atol=ATOL, rtol=0)


def test_zero_rows_is_answered_empty(client, model):
    result = client.logprobs(np.zeros((0, model.hidden), np.float32), [])
    assert result.logprobs.shape == (0,)


def test_request_id_is_echoed(client, model):
    hidden, targets = model.random_rows(1, seed=7)
    assert client.logprobs(hidden, targets, request_id="abc-1").request_id == "abc-1"
