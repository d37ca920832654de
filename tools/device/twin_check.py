"""The trainer's twin on a GPU host, run by `tools/device/run_suite.sh twin`.

Prints one "PASS name: ..." or "FAIL name: ..." line per check and exits
non-zero when any failed:

  twin_logp      10^5 rows: detlogp.torch.linear_logp on CUDA == the CUDA
                 server's logprobs and lse (memcmp), several batch splits
  twin_entropy   the same rows with return_entropy: detlogp.torch and
                 detlogp.ops on CUDA == the CUDA server's entropy (and its
                 logprobs and lse) bit for bit
  twin_key       detlogp.ops.determinism_key(device="cuda:0") == the server's
  twin_h3        detlogp.torch.h3_projection on CUDA == the server's Project
                 (memcmp), and its CUDA gradients == the CPU kernels' bits
  grad_accuracy  the op's backward (on Hopper the fused kernel)
                 vs float64, beside PyTorch eager's error (bf16 logits ->
                 float -> log_softmax): ours <= 1.5x eager's
  grad_memory    peak extra memory of the backward beyond the gradients
                 <= 512 MiB (N = 1024, 16384)
  overhead       forward through the op vs the kernel alone (the bare C ABI
                 launch through ctypes into preallocated buffers): both timed
                 the same way, CUDA events around many back-to-back calls on
                 one stream (host work that stays below the kernel time is
                 hidden, as in a training step), median of interleaved
                 repeats: <= 3% at N >= 256; and the op's GPU work per call
                 (torch.profiler) is exactly the bare launch's kernels
"""

import argparse
import collections
import ctypes
import os
import statistics
import sys
import tempfile
import time

import detlogp
import detlogp.torch as dtorch
import numpy as np
import torch
from detlogp import ops, safetensors_io
from detlogp.testing import LocalServer

RESULTS = []


def report(name, ok, detail):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def bits_equal(a, b):
    a = a.detach().cpu().contiguous().numpy() if isinstance(a, torch.Tensor) else a
    b = b.detach().cpu().contiguous().numpy() if isinstance(b, torch.Tensor) else b
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def served_logp(client, hidden_bits, targets, chunk=4096, entropy=False):
    logp, lse, ent = [], [], []
    for r0 in range(0, hidden_bits.shape[0], chunk):
        res = client.logprobs(
            hidden_bits[r0 : r0 + chunk],
            targets[r0 : r0 + chunk],
            temperature=1.0,
            return_lse=True,
            return_entropy=entropy,
            timeout=120,
        )
        logp.append(res.logprobs)
        lse.append(res.lse)
        if entropy:
            ent.append(res.entropy)
    if entropy:
        return np.concatenate(logp), np.concatenate(lse), np.concatenate(ent)
    return np.concatenate(logp), np.concatenate(lse)


def twin_batches(hidden, weight, targets, bias, vocab, split, entropy):
    """detlogp.torch.linear_logp over every row in batches of `split` (1:
    the first 256 rows one at a time); (logprobs, lse[, entropy])."""
    n = hidden.shape[0]
    step, limit = (split, n) if split > 1 else (1, 256)
    parts = []
    for r0 in range(0, limit, step):
        parts.append(
            dtorch.linear_logp(
                hidden[r0 : r0 + step],
                weight,
                targets[r0 : r0 + step],
                bias,
                vocab_size=vocab,
                return_lse=True,
                return_entropy=entropy,
            )
        )
    return [torch.cat(column) for column in zip(*parts)]


def check_twin(args, workdir):
    H, V, VP = args.hidden, args.vocab, args.padded_vocab
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = (torch.randn(VP, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(VP, device="cuda", generator=g) * 0.5
    proj_w = torch.randn(ops.H3_OUT_DIM, ops.H3_IN_DIM, device="cuda", generator=g) * 0.1
    proj_b = torch.randn(ops.H3_OUT_DIM, device="cuda", generator=g) * 0.1
    path = os.path.join(workdir, "lm_head.safetensors")
    proj_path = os.path.join(workdir, "proj.safetensors")
    t0 = time.time()
    safetensors_io.write(
        path,
        {
            "lm_head.weight": weight.cpu().view(torch.int16).numpy().view(np.uint16),
            "lm_head.bias": bias.cpu().numpy(),
        },
    )
    safetensors_io.write(
        proj_path, {"proj.weight": proj_w.cpu().numpy(), "proj.bias": proj_b.cpu().numpy()}
    )
    print(f"wrote weights in {time.time() - t0:.1f} s", flush=True)
    flags = [
        f"--weights={path}",
        "--lm_head_tensor=lm_head.weight",
        "--bias_tensor=lm_head.bias",
        f"--vocab_size={V}",
        "--device=cuda:0",
        f"--projection_weights={proj_path}",
        "--max_request_rows=65536",
    ]
    n = args.rows
    hidden = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
    targets = torch.randint(0, V, (n,), device="cuda", generator=g)
    hidden_bits = hidden.cpu().view(torch.int16).numpy().view(np.uint16)
    targets_np = targets.cpu().numpy()
    with LocalServer(args.server, flags, start_timeout=300) as server:
        with detlogp.Client(server.target, timeout=300) as client:
            t0 = time.time()
            want_logp, want_lse = served_logp(client, hidden_bits, targets_np)
            print(f"served {n} rows in {time.time() - t0:.1f} s", flush=True)
            t0 = time.time()
            want_e = served_logp(client, hidden_bits, targets_np, entropy=True)
            print(f"served {n} rows with entropy in {time.time() - t0:.1f} s", flush=True)
            info = client.info()
            x = torch.randn(args.proj_rows, ops.H3_IN_DIM, device="cuda", generator=g)
            want_y = client.project(x.cpu().numpy(), timeout=300).y
    with torch.no_grad():
        ok = True
        splits = [n, 8192, 1000, 1]
        for split in splits:
            got_logp, got_lse = twin_batches(hidden, weight, targets, bias, V, split, False)
            rows = got_logp.shape[0]
            same = bits_equal(got_logp, want_logp[:rows]) and bits_equal(got_lse, want_lse[:rows])
            if not same:
                diff = (got_logp.cpu().numpy() != want_logp[:rows]).sum()
                print(f"  batches of {split}: {diff} of {rows} logprobs differ", flush=True)
            ok &= same
        report(
            "twin_logp",
            ok,
            f"{n} rows, H={H} V={V} (V_pad={VP}) with bias, "
            f"batches of {splits[:-1]} and single rows: logprobs and lse "
            f"{'bit-equal to' if ok else 'DIFFER from'} the CUDA server",
        )
        # return_entropy: the served entropy (asked for on the server too),
        # through detlogp.torch in the same batches and through detlogp.ops.
        ok_e, notes = True, []
        for split in splits:
            got = twin_batches(hidden, weight, targets, bias, V, split, True)
            rows = got[0].shape[0]
            for name, mine, want in zip(("logprobs", "lse", "entropy"), got, want_e):
                if not bits_equal(mine, want[:rows]):
                    ok_e = False
                    diff = int((mine.cpu().numpy() != want[:rows]).sum())
                    notes.append(f"torch batches of {split}: {diff} of {rows} {name} differ")
        got = ops.linear_logp(
            hidden, weight, targets, bias, vocab_size=V, return_lse=True, return_entropy=True
        )
        for name, mine, want in zip(("logprobs", "lse", "entropy"), got, want_e):
            if not bits_equal(mine, want):
                ok_e = False
                diff = int((mine.cpu().numpy() != want).sum())
                notes.append(f"ops (all {n} rows at once): {diff} {name} differ")
        for note in notes:
            print(f"  {note}", flush=True)
        finite = bool(np.isfinite(want_e[2]).all()) and float(want_e[2].min()) >= 0
        report(
            "twin_entropy",
            ok_e and finite,
            f"{n} rows with return_entropy: detlogp.torch (batches of "
            f"{splits[:-1]} and single rows) and detlogp.ops (one call): "
            f"entropy, logprobs and lse {'bit-equal to' if ok_e else 'DIFFER from'}"
            f" the CUDA server's (served entropy in [{want_e[2].min():.3f}, "
            f"{want_e[2].max():.3f}] nats{'' if finite else ', NOT finite/>= 0'})",
        )
        key = ops.determinism_key(weight, bias, V, device="cuda:0")
        report(
            "twin_key", key == info.determinism_key, f"ops {key} vs server {info.determinism_key}"
        )
        y = dtorch.h3_projection(x, proj_w, proj_b)
        ok_y = bits_equal(y, want_y)
    # H3 gradients: CUDA kernels == CPU kernels, bit for bit.
    xg = x[:3000].clone().requires_grad_()
    wg = proj_w.clone().requires_grad_()
    bg = proj_b.clone().requires_grad_()
    yg = dtorch.h3_projection(xg, wg, bg)
    dy = torch.randn(yg.shape, device="cuda", generator=g)
    yg.backward(dy)
    dx_cpu = ops.cpu_h3_projection_input_grad(dy.cpu().numpy(), proj_w.cpu().numpy())
    dw_cpu, db_cpu = ops.cpu_h3_projection_weight_grad(dy.cpu().numpy(), x[:3000].cpu().numpy())
    ok_g = (
        bits_equal(xg.grad, dx_cpu) and bits_equal(wg.grad, dw_cpu) and bits_equal(bg.grad, db_cpu)
    )
    report(
        "twin_h3",
        ok_y and ok_g,
        f"{args.proj_rows} rows forward {'==' if ok_y else '!='} the server's "
        f"Project; 3000-row dX/dW/dbias on CUDA {'==' if ok_g else '!='} the CPU "
        "kernels",
    )


def eager_logp(hidden, weight, bias, targets, vocab):
    """What RL frameworks do: bf16 logits -> float -> log_softmax -> gather."""
    logits = (hidden @ weight[:vocab].T).float() + bias[:vocab]
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def check_gradients(args):
    H, V, VP, N = args.hidden, args.vocab, args.padded_vocab, 1024
    g = torch.Generator(device="cuda").manual_seed(2)
    weight = (torch.randn(VP, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(VP, device="cuda", generator=g) * 0.5
    hidden = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    adv = torch.randn(N, device="cuda", generator=g)

    def grads(fn, dtype=None):
        h = (hidden if dtype is None else hidden.to(dtype)).clone().requires_grad_()
        w = (weight if dtype is None else weight.to(dtype)).clone().requires_grad_()
        b = (bias if dtype is None else bias.to(dtype)).clone().requires_grad_()
        loss = (fn(h, w, b) * (adv if dtype is None else adv.to(dtype))).sum()
        loss.backward()
        return h.grad, w.grad, b.grad

    def ref64(h, w, b):
        z = h @ w[:V].T + b[:V]
        return z.gather(1, targets[:, None])[:, 0] - torch.logsumexp(z, dim=1)

    ref = grads(ref64, torch.float64)
    torch.cuda.synchronize()
    ours = grads(lambda h, w, b: dtorch.linear_logp(h, w, targets, b, vocab_size=V))
    eager = grads(lambda h, w, b: eager_logp(h, w, b, targets, V))
    ok = True
    parts = []
    for name, o, e, r in zip(("d_hidden", "d_weight", "d_bias"), ours, eager, ref):
        ro, re = rel(o, r), rel(e, r)
        ok &= ro <= 1.5 * re
        parts.append(f"{name} {ro:.2e} vs eager {re:.2e} ({ro / re:.2f}x)")
    report(
        "grad_accuracy",
        ok,
        f"N={N} H={H} V={V}, relative to float64: " + "; ".join(parts) + " (target <= 1.5x eager)",
    )
    del ref, ours, eager


def check_memory(args):
    H, V, VP = args.hidden, args.vocab, args.padded_vocab
    g = torch.Generator(device="cuda").manual_seed(3)
    weight = (torch.randn(VP, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    weight.requires_grad_()
    ok = True
    parts = []
    for n in (1024, 16384):
        hidden = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
        hidden.requires_grad_()
        targets = torch.randint(0, V, (n,), device="cuda", generator=g)
        weight.grad = None
        logp = dtorch.linear_logp(hidden, weight, targets, vocab_size=V)
        loss = logp.sum()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        loss.backward()
        torch.cuda.synchronize()
        seconds = time.time() - t0
        grads = hidden.grad.numel() * 2 + weight.grad.numel() * 2
        extra = torch.cuda.max_memory_allocated() - before - grads
        ok &= extra <= (512 << 20)
        parts.append(f"N={n}: {extra / 2**20:.0f} MiB extra, {seconds * 1e3:.0f} ms")
        del hidden, logp, loss
    report(
        "grad_memory", ok, "; ".join(parts) + " (target <= 512 MiB beyond the gradients themselves)"
    )


def gpu_work_per_call(fn, calls=4):
    """What one call puts on the GPU, from torch.profiler (CUPTI): a
    {kernel / memset / memcpy name: count per call} dict, or None when the
    profiler cannot see the GPU here."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        names = collections.Counter(
            e.name for e in prof.events() if e.device_type == DeviceType.CUDA
        )
    except Exception as error:  # no CUPTI: the timing still stands
        print(f"  torch.profiler unavailable: {error}", flush=True)
        return None
    if not names:
        return None
    return {name: count / calls for name, count in sorted(names.items())}


def timed_calls(fn, count):
    """(GPU seconds per call, host seconds per call) of `count` back-to-back
    calls on the current stream: CUDA events before the first and after the
    last launch, the host never waiting in between, so host work shorter than
    the kernels hides behind them as in a training step."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / count, host / count


def short(name):
    return name.split("(")[0].split("<")[0].split("::")[-1][:40]


def check_overhead(args):
    """The op as a trainer calls it (int64 targets, temperature 1.0, no
    preallocated outputs) against the bare library launch on the same inputs
    into preallocated buffers: both are Python loops of back-to-back calls
    timed with CUDA events (timed_calls); medians of interleaved repeats. A
    CUDA-graph replay of the bare launch is printed for reference (it has
    no launch gaps, so it is not the comparison the target is about)."""
    H, V, VP = args.hidden, args.vocab, args.padded_vocab
    g = torch.Generator(device="cuda").manual_seed(4)
    weight = (torch.randn(VP, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    lib = ops.load_cuda_library()
    ok = True
    parts = []
    for n in (256, 1024, 4096):
        hidden = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
        targets = torch.randint(0, V, (n,), device="cuda", generator=g)  # int64
        logp = torch.empty(n, device="cuda")
        lse = torch.empty(n, device="cuda")
        handle = ops._lm_heads.get(lib, weight, None, V, 0)
        ws_bytes = lib.detlogp_cuda_linear_logp_workspace_bytes(handle, n, 0)
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
        error = ctypes.create_string_buffer(1024)

        def bare():
            rc = lib.detlogp_cuda_linear_logp(
                handle,
                hidden.data_ptr(),
                n,
                targets.data_ptr(),
                1,
                None,
                1.0,
                logp.data_ptr(),
                lse.data_ptr(),
                None,
                ws.data_ptr(),
                ws_bytes,
                torch.cuda.current_stream().cuda_stream,
                error,
                1024,
            )
            assert rc == 0, error.value

        def op():
            dtorch.linear_logp(hidden, weight, targets, vocab_size=V)

        work_bare, work_op = gpu_work_per_call(bare), gpu_work_per_call(op)
        same_work = work_bare is None or work_op is None or work_bare == work_op
        ok &= same_work
        if not same_work:
            print(f"  N={n}: op GPU work {work_op} != bare {work_bare}", flush=True)
        # Enough calls for ~0.25 s of kernels per measurement.
        per_call, _ = timed_calls(bare, 10)
        count = max(args.iters, int(0.25 / per_call))
        kernel, through_op, host_op, host_bare = [], [], [], []
        for _ in range(args.repeats):  # interleaved
            gpu, host = timed_calls(bare, count)
            kernel.append(gpu)
            host_bare.append(host)
            gpu, host = timed_calls(op, count)
            through_op.append(gpu)
            host_op.append(host)
        k, o = statistics.median(kernel), statistics.median(through_op)
        overhead = o / k - 1
        ok &= overhead <= 0.03
        # Reference only: the bare launch replayed from a CUDA graph.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            bare()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(20):
                    bare()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        replays = max(1, count // 20)
        graphed = statistics.median(
            timed_calls(graph.replay, replays)[0] / 20 for _ in range(args.repeats)
        )
        del graph
        work = (
            "GPU work/call "
            + (
                ", ".join(f"{short(k_)} x{v:g}" for k_, v in work_op.items())
                if work_op
                else "n/a (no profiler)"
            )
            + (" == bare" if same_work and work_op else "")
        )
        parts.append(
            f"N={n}: kernel {k * 1e6:.1f} us, op {o * 1e6:.1f} us "
            f"({overhead * 100:+.1f}%; {count} calls x {args.repeats}, "
            f"min {min(kernel) * 1e6:.1f}/{min(through_op) * 1e6:.1f}); "
            f"host/call op {statistics.median(host_op) * 1e6:.0f} us, bare "
            f"{statistics.median(host_bare) * 1e6:.0f} us; graph-replayed "
            f"kernel {graphed * 1e6:.1f} us; {work}"
        )
    report(
        "overhead",
        ok,
        "; ".join(parts) + " (target <= +3% at N >= 256, op GPU work == the bare launch's)",
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--proj_rows", type=int, default=20_000)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--padded_vocab", type=int, default=151_936)
    parser.add_argument(
        "--iters",
        type=int,
        default=200,
        help="fewest calls per overhead measurement (more are run to fill ~0.25 s)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="interleaved overhead measurements per side"
    )
    parser.add_argument("--only", default="twin,grad,memory,overhead")
    args = parser.parse_args()
    ok, why = ops.cuda_available()
    if not ok:
        report("cuda_ops", False, why)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    checks = {
        "twin": lambda: check_twin(args, tempfile.mkdtemp(prefix="twin-")),
        "grad": lambda: check_gradients(args),
        "memory": lambda: check_memory(args),
        "overhead": lambda: check_overhead(args),
    }
    for name in args.only.split(","):
        try:
            checks[name]()
        except Exception as error:  # one failing check must not hide the others
            import traceback

            traceback.print_exc()
            report(name, False, f"raised {type(error).__name__}: {error}")
        torch.cuda.empty_cache()
    print(f"{sum(RESULTS)} passed, {len(RESULTS) - sum(RESULTS)} failed", flush=True)
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
