"""detlogp.torch where trainers run it: every custom op passes
torch.library.opcheck; forward and backward under torch.compile(fullgraph=True)
give the eager op's bits; on CUDA, a graph captured with torch.cuda.graph and
torch.compile(mode="reduce-overhead") replays the eager op's bits, a head made
while a graph captures included.

CPU cases run wherever PyTorch is installed (torch.compile on the CPU needs a
C++ compiler). CUDA cases need a GPU and libdetlogp_ops_cuda.so
($DETLOGP_OPS_CUDA_LIBRARY, or bazel-bin/kernels/capi/ of the repository) and
skip otherwise; the fused backward's cases need compute capability 9.0:

    DETLOGP_OPS_CUDA_LIBRARY=$PWD/bazel-bin/kernels/capi/libdetlogp_ops_cuda.so \\
      python -m pytest client/python/tests/test_torch_compile.py -k cuda
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


@pytest.fixture
def cuda():
    """Skips unless the CUDA ops can run on cuda:0."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ok, why = ops.cuda_available(0)
    if not ok:
        pytest.skip(why)
    return torch.device("cuda", 0)


@pytest.fixture
def hopper(cuda):
    """cuda:0 with the fused backward (compute capability 9.0)."""
    if torch.cuda.get_device_capability(cuda) != (9, 0):
        pytest.skip("the fused linear-logp backward is the Hopper kernel's (sm_90)")
    return cuda


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test compiles its own graphs (no cache hit hides a failure)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def bits(tensor):
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bf16: its bits as int16
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


# Shapes: on CUDA the Hopper kernels want H a multiple of 64; a vocabulary
# over 4096 rows spans two of the fused backward's column chunks.
SHAPES = {
    "cpu": dict(rows=24, hidden=64, padded=320, vocab=300),
    "cuda": dict(rows=96, hidden=128, padded=4224, vocab=4200),
}


def make_case(device, seed, with_bias=True, per_row_temperature=True):
    """Inputs of one step, made on the CPU from `seed` and moved to device."""
    shape = SHAPES[torch.device(device).type]
    g = torch.Generator().manual_seed(seed)
    rows, h, padded, vocab = shape["rows"], shape["hidden"], shape["padded"], shape["vocab"]
    case = {
        "hidden": torch.randn(rows, h, generator=g).to(torch.bfloat16),
        "weight": (torch.randn(padded, h, generator=g) * 0.3).to(torch.bfloat16),
        "bias": torch.randn(padded, generator=g) * 0.5 if with_bias else None,
        "targets": torch.randint(0, vocab, (rows,), generator=g),
        "temperature": torch.rand(rows, generator=g) + 0.5 if per_row_temperature else 0.8,
        "upstream": torch.randn(3, rows, generator=g),
    }
    case = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    case["vocab"] = vocab
    return case


def step(hidden, weight, bias, targets, temperature, upstream, vocab):
    """A loss through logprobs, lse and entropy (every gradient path)."""
    logp, lse, entropy = dtorch.linear_logp(
        hidden,
        weight,
        targets,
        bias,
        temperature=temperature,
        vocab_size=vocab,
        return_lse=True,
        return_entropy=True,
    )
    loss = (upstream[0] * logp + upstream[1] * lse + upstream[2] * entropy).sum()
    return loss, logp, lse, entropy


def leaves(case):
    """Fresh leaf tensors (hidden, weight, bias) that require grad."""
    return [
        None if case[k] is None else case[k].detach().clone().requires_grad_()
        for k in ("hidden", "weight", "bias")
    ]


def run(fn, case):
    """Outputs (after the loss) and gradients (hidden, weight, bias) of one
    forward and backward through fn. The loss's own bits may differ between
    compiled and eager code (its sum may be reordered); its gradient with
    respect to each output is the upstream tensor either way."""
    hidden, weight, bias = leaves(case)
    loss, *outputs = fn(
        hidden,
        weight,
        bias,
        case["targets"],
        case["temperature"],
        case["upstream"],
        case["vocab"],
    )
    loss.backward()
    grads = [None if t is None else t.grad for t in (hidden, weight, bias)]
    return [o.detach().clone() for o in outputs], grads


def assert_same_bits(got, want, what):
    (got_out, got_grads), (want_out, want_grads) = got, want
    for name, a, b in zip(("logprobs", "lse", "entropy"), got_out, want_out):
        assert bits(a) == bits(b), f"{what}: {name} differs from eager"
    for name, a, b in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert (a is None) == (b is None), f"{what}: d {name} missing"
        if a is not None:
            assert bits(a) == bits(b), f"{what}: d {name} differs from eager"


# ------------------------------------------------------------------ opcheck
def linear_logp_args(case, return_entropy=True):
    temperature = case["temperature"]
    scalar = not isinstance(temperature, torch.Tensor)
    return (
        case["hidden"],
        case["weight"],
        case["targets"],
        case["bias"],
        None if scalar else temperature,
        float(temperature) if scalar else 1.0,
        case["vocab"],
        return_entropy,
    )


def backward_args(case, need=(True, True, True), return_entropy=True):
    forward = linear_logp_args(case, return_entropy)
    _, lse, entropy = dtorch._linear_logp_op(*forward)
    up = case["upstream"]
    return (
        *forward[:7],
        lse,
        entropy,
        up[0],
        up[1],
        up[2] if return_entropy else None,
        *need,
    )


def opcheck_all(device, backward_op):
    for seed, with_bias, per_row in ((1, True, True), (2, False, False)):
        case = make_case(device, seed, with_bias, per_row)
        for return_entropy in (True, False):
            args = linear_logp_args(case, return_entropy)
            torch.library.opcheck(dtorch._linear_logp_op, args)
            # With gradients asked for: autograd through the backward op.
            grad_args = tuple(
                a.detach().clone().requires_grad_()
                if i in (0, 1, 3) and isinstance(a, torch.Tensor) and a.is_floating_point()
                else a
                for i, a in enumerate(args)
            )
            torch.library.opcheck(dtorch._linear_logp_op, grad_args)
        for need in ((True, True, True), (True, False, False), (False, True, False)):
            torch.library.opcheck(backward_op, backward_args(case, need))
        torch.library.opcheck(backward_op, backward_args(case, return_entropy=False))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, ops.H3_IN_DIM, generator=g).to(device)
    w = (torch.randn(ops.H3_OUT_DIM, ops.H3_IN_DIM, generator=g) * 0.1).to(device)
    b = torch.randn(ops.H3_OUT_DIM, generator=g).to(device)
    dy = torch.randn(5, ops.H3_OUT_DIM, generator=g).to(device)
    torch.library.opcheck(dtorch._h3_projection_op, (x, w, b))
    torch.library.opcheck(dtorch._h3_projection_op, (x, w, None))
    torch.library.opcheck(
        dtorch._h3_projection_op, tuple(t.clone().requires_grad_() for t in (x, w, b))
    )
    torch.library.opcheck(dtorch._h3_input_grad_op, (dy, w))
    torch.library.opcheck(dtorch._h3_weight_grad_op, (dy, x))


def test_opcheck_every_op_on_the_cpu():
    opcheck_all("cpu", dtorch._chunked_backward_op)
    # The float64 reference path (gradcheck's) as well.
    case = make_case("cpu", 4)
    case = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in case.items()
    }
    torch.library.opcheck(dtorch._linear_logp_op, linear_logp_args(case))
    torch.library.opcheck(dtorch._chunked_backward_op, backward_args(case))


def test_opcheck_every_op_on_cuda(cuda):
    opcheck_all(cuda, dtorch._chunked_backward_op)


def test_opcheck_the_fused_backward_on_cuda(hopper):
    opcheck_all(hopper, dtorch._fused_backward_op)


def test_the_fused_backward_op_refuses_other_devices():
    case = make_case("cpu", 5)
    with pytest.raises(ValueError, match="weight: on cpu; the fused linear-logp backward"):
        dtorch._fused_backward_op(*backward_args(case))


# ------------------------------------------------------------------ compile
def compiled_equals_eager(device, **options):
    compiled = torch.compile(step, fullgraph=True, **options)
    for seed, with_bias, per_row in ((10, True, True), (11, False, False), (12, True, False)):
        case = make_case(device, seed, with_bias, per_row)
        want = run(step, case)
        for attempt in range(2):  # the first call compiles, the second reuses
            assert_same_bits(run(compiled, case), want, f"seed {seed}, call {attempt}")
    # Entropy not asked for: no entropy gradient reaches the backward.
    case = make_case(device, 13)

    def no_entropy(hidden, weight, bias, targets, temperature, upstream, vocab):
        logp, lse = dtorch.linear_logp(
            hidden, weight, targets, bias, temperature, vocab, return_lse=True
        )
        return (upstream[0] * logp + upstream[1] * lse).sum(), logp, lse

    want = run(no_entropy, case)
    got = run(torch.compile(no_entropy, fullgraph=True, **options), case)
    assert_same_bits(got, want, "without entropy")


def test_compiled_forward_and_backward_equal_eager_on_the_cpu():
    compiled_equals_eager("cpu")


def test_compiled_h3_projection_equals_eager_on_the_cpu():
    g = torch.Generator().manual_seed(20)
    x = torch.randn(7, ops.H3_IN_DIM, generator=g)
    w = torch.randn(ops.H3_OUT_DIM, ops.H3_IN_DIM, generator=g) * 0.1
    b = torch.randn(ops.H3_OUT_DIM, generator=g)
    dy = torch.randn(7, ops.H3_OUT_DIM, generator=g)

    def grads(fn):
        inputs = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(*inputs)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in inputs]

    compiled = torch.compile(dtorch.h3_projection, fullgraph=True)
    for got, want in zip(grads(compiled), grads(dtorch.h3_projection)):
        assert bits(got) == bits(want)


def test_compiled_forward_and_backward_equal_eager_on_cuda(cuda):
    compiled_equals_eager(cuda)


# ------------------------------------------------------------------ CUDA graphs
def copy_case(into, case):
    with torch.no_grad():
        for key, value in case.items():
            if isinstance(value, torch.Tensor):
                into[key].copy_(value)


def test_cuda_graph_replay_equals_eager(cuda):
    """Forward and backward captured once with torch.cuda.graph, replayed on
    new inputs copied into the captured ones (the weight updated in place, as
    an optimizer does): eager's bits every time."""
    static = make_case(cuda, 30)
    hidden, weight, bias = leaves(static)

    def captured_step():
        loss, logp, lse, entropy = step(
            hidden,
            weight,
            bias,
            static["targets"],
            static["temperature"],
            static["upstream"],
            static["vocab"],
        )
        loss.backward()
        return logp, lse, entropy

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: every lazy set-up before capture
        for _ in range(2):
            captured_step()
            for t in (hidden, weight, bias):
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = captured_step()
    for seed in (31, 32, 33):
        case = make_case(cuda, seed)
        copy_case(static, case)
        with torch.no_grad():
            hidden.copy_(case["hidden"]), weight.copy_(case["weight"]), bias.copy_(case["bias"])
        graph.replay()
        got = ([o.clone() for o in outputs], [t.grad.clone() for t in (hidden, weight, bias)])
        assert_same_bits(got, run(step, case), f"replay with seed {seed}")


def test_cuda_graph_capture_makes_a_new_head(cuda, monkeypatch):
    """A weight whose kernel handle is first made while a graph captures (the
    handle cache emptied): the capture stays valid and replays eager's
    forward bits."""
    warm = make_case(cuda, 40)
    run(step, warm)  # the kernels are loaded
    monkeypatch.setattr(ops, "_lm_heads", ops._LmHeadCache())  # no head yet
    case = make_case(cuda, 41)
    weight = case["weight"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logp, lse, entropy = dtorch.linear_logp(
            case["hidden"],
            weight,
            case["targets"],
            case["bias"],
            temperature=case["temperature"],
            vocab_size=case["vocab"],
            return_lse=True,
            return_entropy=True,
        )
    graph.replay()
    want = dtorch.linear_logp(
        case["hidden"],
        case["weight"],
        case["targets"],
        case["bias"],
        temperature=case["temperature"],
        vocab_size=case["vocab"],
        return_lse=True,
        return_entropy=True,
    )
    for name, got, ref in zip(("logprobs", "lse", "entropy"), (logp, lse, entropy), want):
        assert bits(got) == bits(ref), name


def test_reduce_overhead_forward_and_backward_equal_eager_on_cuda(cuda):
    """torch.compile(mode="reduce-overhead"): warm-up, recording and replays
    of forward and backward (CUDA graph trees, inputs copied into their static
    buffers) give eager's bits."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for seed in range(50, 55):
        torch.compiler.cudagraph_mark_step_begin()
        case = make_case(cuda, seed)
        assert_same_bits(run(compiled, case), run(step, case), f"call with seed {seed}")
    # Graphs really ran: inductor skipped none (a skip falls back to eager).
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_cuda_graph_replay_of_the_h3_projection(cuda):
    g = torch.Generator().manual_seed(60)
    x = torch.randn(6, ops.H3_IN_DIM, generator=g).to(cuda)
    w = (torch.randn(ops.H3_OUT_DIM, ops.H3_IN_DIM, generator=g) * 0.1).to(cuda)
    b = torch.randn(ops.H3_OUT_DIM, generator=g).to(cuda)
    dtorch.h3_projection(x, w, b)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = dtorch.h3_projection(x, w, b)
    with torch.no_grad():
        x.copy_(torch.randn(6, ops.H3_IN_DIM, generator=g).to(cuda))
    graph.replay()
    assert bits(y) == bits(dtorch.h3_projection(x, w, b))
    cpu = ops.h3_projection(x.cpu().numpy(), w.cpu().numpy(), b.cpu().numpy())
    assert bits(y) == np.ascontiguousarray(cpu).tobytes()
