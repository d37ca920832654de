"""detlogp.torch: the custom ops on CPU tensors give the CPU
server's bits, gradcheck passes on the float64 path, the chunked backward
matches float64, and the ops trace under fake tensors. tools/test_python.sh
installs PyTorch (the module skips where it is missing); CUDA cases run only
on a GPU with the CUDA library built (tools/device/run_suite.sh twin runs the full
CUDA contract; test_torch_compile.py covers torch.compile and CUDA graphs).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import detlogp.torch as dtorch  # noqa: E402
from detlogp import ops  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def ops_library(repo_root):
    path = ops.find_library(repo_root)
    if path is None or not path.exists():
        pytest.fail(
            "no ops library: run `bazel build //kernels/capi:libdetlogp_ops.so`", pytrace=False
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ops.LIBRARY_ENV, str(path))
        cuda_path = ops.find_cuda_library(repo_root)
        if cuda_path is not None:
            patch.setenv(ops.CUDA_LIBRARY_ENV, str(cuda_path))
        yield path


def bits(tensor):
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bf16: its bits as int16
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def test_cpu_bits_equal_the_cpu_server(client, model):
    hidden, targets = model.random_rows(33, seed=4242)
    served = client.logprobs(hidden, targets, temperature=0.8, return_lse=True)
    weight = torch.from_numpy(model.weight_bits.view(np.int16)).view(torch.bfloat16)
    bias = torch.from_numpy(model.bias)
    logp, lse = dtorch.linear_logp(
        torch.from_numpy(hidden),
        weight,
        torch.from_numpy(targets),
        bias,
        temperature=0.8,
        vocab_size=model.vocab,
        return_lse=True,
    )
    assert logp.dtype == torch.float32
    assert bits(logp) == served.logprobs.tobytes()
    assert bits(lse) == served.lse.tobytes()
    # bf16 hidden: the same rounded values, the same bits.
    again = dtorch.linear_logp(
        torch.from_numpy(hidden).to(torch.bfloat16),
        weight,
        torch.from_numpy(targets),
        bias,
        temperature=0.8,
        vocab_size=model.vocab,
    )
    assert bits(again) == served.logprobs.tobytes()


def test_projection_bits_and_grads_are_the_kernels():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((9, ops.H3_IN_DIM)).astype(np.float32))
    w = torch.from_numpy(
        (rng.standard_normal((ops.H3_OUT_DIM, ops.H3_IN_DIM)) * 0.1).astype(np.float32)
    )
    b = torch.from_numpy(rng.standard_normal(ops.H3_OUT_DIM).astype(np.float32))
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = dtorch.h3_projection(x, w, b)
    assert (
        bits(y)
        == ops.h3_projection(x.detach().numpy(), w.detach().numpy(), b.detach().numpy()).tobytes()
    )
    dy = torch.from_numpy(rng.standard_normal(tuple(y.shape)).astype(np.float32))
    y.backward(dy)
    assert (
        bits(x.grad) == ops.cpu_h3_projection_input_grad(dy.numpy(), w.detach().numpy()).tobytes()
    )
    dweight, dbias = ops.cpu_h3_projection_weight_grad(dy.numpy(), x.detach().numpy())
    assert bits(w.grad) == dweight.tobytes() and bits(b.grad) == dbias.tobytes()


def test_gradcheck_float64_linear_logp():
    torch.manual_seed(0)
    hidden = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(13, 8, dtype=torch.float64) * 0.5).requires_grad_()
    bias = torch.randn(13, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 4, 9, 10])
    temps = torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64)

    def f(h, w, b):
        return dtorch.linear_logp(
            h, w, targets, b, temperature=temps, vocab_size=11, return_lse=True, return_entropy=True
        )

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_gradcheck_float64_linear_logp_in_many_tiles(monkeypatch):
    monkeypatch.setattr(dtorch, "BACKWARD_BUDGET_BYTES", 64 << 10)
    assert dtorch._row_chunk(40, 32, 300, (64 << 10) / 2) < 40  # really tiled
    torch.manual_seed(1)
    hidden = torch.randn(40, 32, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(320, 32, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    assert torch.autograd.gradcheck(
        lambda h, w: dtorch.linear_logp(h, w, targets, vocab_size=300),
        (hidden, weight),
        fast_mode=True,
    )


def test_gradcheck_float64_h3_projection():
    torch.manual_seed(2)
    x = torch.randn(3, ops.H3_IN_DIM, dtype=torch.float64, requires_grad=True)
    w = torch.randn(ops.H3_OUT_DIM, ops.H3_IN_DIM, dtype=torch.float64, requires_grad=True)
    b = torch.randn(ops.H3_OUT_DIM, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(dtorch.h3_projection, (x, w, b), fast_mode=True)


def test_bf16_backward_is_close_to_float64_and_padding_gets_none(monkeypatch):
    monkeypatch.setattr(dtorch, "BACKWARD_BUDGET_BYTES", 64 << 10)  # several tiles
    torch.manual_seed(3)
    vocab, padded, n, h = 900, 960, 37, 64
    weight = (torch.randn(padded, h) * 0.3).to(torch.bfloat16).requires_grad_()
    bias = (torch.randn(padded) * 0.5).requires_grad_()
    hidden = torch.randn(n, h).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    logp = dtorch.linear_logp(hidden, weight, targets, bias, temperature=0.7, vocab_size=vocab)
    (logp * torch.linspace(0.5, 1.5, n)).sum().backward()
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    z = (h64 @ w64[:vocab].T + b64[:vocab]) / 0.7
    want = z.gather(1, targets[:, None])[:, 0] - torch.logsumexp(z, 1)
    (want * torch.linspace(0.5, 1.5, n, dtype=torch.float64)).sum().backward()
    assert float((logp.detach().double() - want.detach()).abs().max()) < 1e-4
    for got, ref in ((hidden.grad, h64.grad), (weight.grad, w64.grad), (bias.grad, b64.grad)):
        assert float((got.double() - ref).norm() / ref.norm()) < 4e-3
    assert float(weight.grad[vocab:].abs().max()) == 0.0
    assert float(bias.grad[vocab:].abs().max()) == 0.0


def test_inputs_are_checked_with_the_argument_named():
    weight = torch.zeros(16, 8, dtype=torch.bfloat16)
    hidden = torch.zeros(2, 8)
    targets = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden: expected"):
        dtorch.linear_logp(torch.zeros(2, 9), weight, targets)
    with pytest.raises(ValueError, match="weight: not contiguous"):
        dtorch.linear_logp(hidden, torch.zeros(8, 16, dtype=torch.bfloat16).T, targets)
    with pytest.raises(ValueError, match="targets: expected"):
        dtorch.linear_logp(hidden, weight, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="temperature"):
        dtorch.linear_logp(hidden, weight, targets, temperature=0.0)
    with pytest.raises(TypeError, match="x: dtype"):
        dtorch.h3_projection(torch.zeros(2, 96, dtype=torch.float16), torch.zeros(5376, 96), None)


def test_fake_tensors_give_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = torch.empty(5, 64, dtype=torch.bfloat16)
        weight = torch.empty(128, 64, dtype=torch.bfloat16)
        logp, lse = dtorch.linear_logp(
            hidden, weight, torch.zeros(5, dtype=torch.int64), return_lse=True
        )
        assert logp.shape == (5,) and lse.dtype == torch.float32
        y = dtorch.h3_projection(torch.empty(3, 96), torch.empty(5376, 96), None)
        assert y.shape == (3, 5376)


def test_opcheck():
    torch.manual_seed(4)
    weight = (torch.randn(64, 32) * 0.3).to(torch.bfloat16)
    hidden = torch.randn(6, 32).to(torch.bfloat16)
    targets = torch.randint(0, 64, (6,))
    for args in (
        (hidden, weight, targets, None, torch.ones(6), 1.0, 64, False),
        (hidden, weight, targets, None, None, 0.7, 64, True),
    ):
        torch.library.opcheck(
            dtorch._linear_logp_op, args, test_utils=("test_schema", "test_faketensor")
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_forward_is_batch_invariant_and_backward_runs():
    ok, why = ops.cuda_available()
    if not ok:
        pytest.skip(why)
    torch.manual_seed(5)
    weight = (torch.randn(4096, 256, device="cuda") * 0.1).to(torch.bfloat16)
    hidden = torch.randn(100, 256, device="cuda").to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 4000, (100,), device="cuda")
    logp = dtorch.linear_logp(hidden, weight, targets, vocab_size=4000)
    alone = dtorch.linear_logp(hidden[37:38], weight, targets[37:38], vocab_size=4000)
    assert bits(alone) == bits(logp[37:38])
    logp.sum().backward()
    assert hidden.grad is not None and bool(torch.isfinite(hidden.grad.float()).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_fused_backward_is_batch_invariant_deterministic_and_accurate():
    """On an sm_90 GPU the op's backward is the fused kernel: a
    row's d hidden alone == inside the batch (bits), two identical backward
    calls give the same d weight and d bias bits, and every gradient (through
    logprobs, lse and entropy, with bias and per-row temperatures) is close
    to the float64 reference."""
    ok, why = ops.cuda_available()
    if not ok:
        pytest.skip(why)
    torch.manual_seed(8)
    vocab, padded, n, h = 4000, 4096, 300, 256
    weight = (torch.randn(padded, h, device="cuda") * 0.1).to(torch.bfloat16)
    bias = torch.randn(padded, device="cuda") * 0.5
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused backward is the Hopper kernel's")
    assert ops.cuda_fused_backward_available(weight, bias, vocab)
    hidden = torch.randn(n, h, device="cuda").to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device="cuda")
    temps = torch.rand(n, device="cuda") + 0.5
    a, b, c = (torch.randn(n, device="cuda") for _ in range(3))

    def grads(rows, dtype=None, device="cuda"):
        args = [hidden[rows], weight, bias]
        if dtype is not None:
            args = [t.to(device=device, dtype=dtype) for t in args]
        leaves = [t.detach().clone().requires_grad_() for t in args]
        logp, lse, ent = dtorch.linear_logp(
            leaves[0],
            leaves[1],
            targets[rows].to(device),
            leaves[2],
            temperature=temps[rows].to(device, leaves[2].dtype),
            vocab_size=vocab,
            return_lse=True,
            return_entropy=True,
        )
        up = [t[rows].to(device, logp.dtype) for t in (a, b, c)]
        (up[0] * logp + up[1] * ent + up[2] * lse).sum().backward()
        return [t.grad for t in leaves]

    every = slice(0, n)
    d_hidden, d_weight, d_bias = grads(every)
    again = grads(every)
    assert bits(again[1]) == bits(d_weight), "d_weight differs between two calls"
    assert bits(again[2]) == bits(d_bias), "d_bias differs between two calls"
    for row in (0, 37, n - 1):
        alone = grads(slice(row, row + 1))
        assert bits(alone[0]) == bits(d_hidden[row : row + 1]), f"row {row} alone"
    want = grads(every, torch.float64, "cpu")
    for name, got, ref in zip(("hidden", "weight", "bias"), (d_hidden, d_weight, d_bias), want):
        ref = ref.to(got.device)
        error = float((got.double() - ref).norm() / ref.norm())
        assert error < 4e-3, f"d_{name}: relative error {error:.3g} vs float64"
    assert float(d_weight[vocab:].abs().max()) == 0.0
    assert float(d_bias[vocab:].abs().max()) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_forward_reads_inputs_in_place_with_the_same_bits():
    """int64 targets and a scalar temperature are read as they are (no
    converted copies): the same bits as int32 targets and a [N] tensor; an
    invalid target gives NaN without any fill of the outputs."""
    ok, why = ops.cuda_available()
    if not ok:
        pytest.skip(why)
    torch.manual_seed(6)
    weight = (torch.randn(4096, 256, device="cuda") * 0.1).to(torch.bfloat16)
    hidden = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    targets = torch.randint(0, 4000, (300,), device="cuda")
    targets[7] = 4000  # padding row: invalid
    targets[8] = -1
    targets[9] = 1 << 40  # beyond int32
    a = dtorch.linear_logp(
        hidden,
        weight,
        targets,
        temperature=0.7,
        vocab_size=4000,
        return_lse=True,
        return_entropy=True,
    )
    t32 = targets.clamp(-1, 4000).to(torch.int32)
    b = dtorch.linear_logp(
        hidden,
        weight,
        t32,
        temperature=torch.full((300,), 0.7, device="cuda"),
        vocab_size=4000,
        return_lse=True,
        return_entropy=True,
    )
    for x, y in zip(a, b):
        assert bits(x) == bits(y)
    logp = a[0].cpu()
    assert bool(torch.isnan(logp[7:10]).all())
    assert bool(torch.isfinite(logp[:7]).all()) and bool(torch.isfinite(logp[10:]).all())
    assert bool(torch.isfinite(a[1]).all())
