"""Forward + backward of linear-logp on a Hopper GPU, one run beside
PyTorch eager and Liger-Kernel's fused linear cross-entropy (when its wheel
is installed), at the target shapes: H = 4096, V = 151936, bf16, loss =
sum_i a_i * logp_i with random per-row weights a_i.

  ours    detlogp.ops.cuda_linear_logp (the served forward) +
          detlogp.ops.cuda_linear_logp_backward (sm90a-wgmma-bwd-v1)
  eager   logits = hidden @ W^T (bf16) -> float -> log_softmax -> gather,
          autograd
  liger   LigerFusedLinearCrossEntropyLoss(reduction="sum"): the same FLOPs;
          uniform per-row weights (it has no per-row weights)

For each N: median of --repeats CUDA-event timings (fresh random data per
size, a warm-up call first), peak extra device memory over the inputs
(torch.cuda.max_memory_allocated), TFLOP/s counting 8·N·H·V for the pair,
and, for ours and eager, the relative Frobenius error of dhidden and
dweight vs float64 at N = 1024 (row subset for dhidden). Prints one line
per (method, N) and a final PASS/FAIL line per target (docs/kernels.md,
the fused backward).

With --profile N: also one profiled call of ours at N, its GPU time per
kernel (torch.profiler), to place the time between the forward and the
backward's K1/K2/K3/dbias launches.

Usage: python3 tools/device/logp_backward_bench.py [--sizes 1024,4096,8192,16384]
         [--profile 16384] [--weight_grad_dtype bf16|fp32]
"""

import argparse
import statistics

import torch
from detlogp import ops

H, V = 4096, 151936
TARGET_MS = {1024: 10.0, 4096: 36.0, 8192: 70.0, 16384: 140.0}


def time_ms(fn, repeats):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def peak_extra_bytes(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


WEIGHT_GRAD_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_ours(weight_grad_dtype):
    def ours(hidden, weight, targets, a):
        logp, lse, _ = ops.cuda_linear_logp(hidden, weight, targets, 1.0)
        return ops.cuda_linear_logp_backward(
            hidden,
            weight,
            targets,
            lse,
            grad_logprobs=a,
            need_hidden=True,
            need_weight=True,
            weight_grad_dtype=weight_grad_dtype,
        )

    return ours


def profile_kernels(fn, label):
    """GPU time per kernel name of one call of fn (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = event.self_cuda_time_total
        if us > 0:
            name = event.key if len(event.key) < 90 else event.key[:87] + "..."
            totals[name] = (event.count, us)
    total = sum(us for _, us in totals.values())
    print(f"profile {label}: {total / 1e3:.2f} ms of GPU time")
    for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {us / 1e3:8.2f} ms {100 * us / total:5.1f}% x{count:4d}  {name}")


def eager(hidden, weight, targets, a):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    logits = (h @ w.t()).float()
    logp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None].long())[:, 0]
    (a * logp).sum().backward()
    return h.grad, w.grad


def liger_fn():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run(hidden, weight, targets, a):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        loss_fn(w, h, targets.long()).backward()
        return h.grad, w.grad

    return run


def float64_grads(hidden, weight, targets, a, rows):
    """dhidden of `rows` and dweight over all rows, float64 on the GPU."""
    h = hidden.double()
    z = h @ weight.double().t()
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    g = -torch.exp(z - lse) * a.double()[:, None]
    g[torch.arange(len(targets)), targets.long()] += a.double()
    return g[rows] @ weight.double(), g.t() @ h


def rel_error(got, want):
    return (torch.linalg.norm(got.double() - want) / torch.linalg.norm(want)).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1024,4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--weight_grad_dtype", choices=sorted(WEIGHT_GRAD_DTYPE), default="bf16")
    args = parser.parse_args()
    ours = make_ours(WEIGHT_GRAD_DTYPE[args.weight_grad_dtype])
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(15)
    weight = (torch.randn((V, H), device="cuda", generator=gen) * 0.02).bfloat16()
    liger = liger_fn()
    methods = [("ours", ours), ("eager", eager)] + ([("liger", liger)] if liger is not None else [])
    if liger is None:
        print("liger: not installed (pip install liger-kernel), skipped")
    verdicts = []
    for n in [int(s) for s in args.sizes.split(",") if s]:
        hidden = torch.randn((n, H), device="cuda", generator=gen).bfloat16()
        targets = torch.randint(0, V, (n,), device="cuda", generator=gen, dtype=torch.int32)
        a = torch.rand((n,), device="cuda", generator=gen)
        for name, fn in methods:
            ms = time_ms(lambda: fn(hidden, weight, targets, a), args.repeats)
            extra = peak_extra_bytes(lambda: fn(hidden, weight, targets, a))
            tflops = 8 * n * H * V / (ms * 1e-3) / 1e12
            print(
                f"{name:6s} N={n:6d}: {ms:8.2f} ms  {tflops:6.1f} TFLOP/s (8NHV)  "
                f"peak extra {extra / 2**20:8.0f} MiB",
                flush=True,
            )
            if name == "ours":
                verdicts.append(
                    (
                        f"time N={n} <= {TARGET_MS.get(n)} ms",
                        n not in TARGET_MS or ms <= TARGET_MS[n],
                    )
                )
                # Extra beyond inputs, saved state and gradient outputs.
                weight_grad_bytes = 4 if args.weight_grad_dtype == "fp32" else 2
                outputs = n * H * 2 + V * H * weight_grad_bytes + n * 8
                verdicts.append((f"memory N={n} <= 512 MiB", extra - outputs <= 512 * 2**20))
        if n == 1024:
            rows = torch.arange(0, n, 8, device="cuda")
            want_h, want_w = float64_grads(hidden, weight, targets, a, rows)
            dh, dw, _ = ours(hidden, weight, targets, a)
            eh, ew = eager(hidden, weight, targets, a)
            errors = {
                "ours": (rel_error(dh[rows], want_h), rel_error(dw, want_w)),
                "eager": (rel_error(eh[rows], want_h), rel_error(ew, want_w)),
            }
            for name, (e_h, e_w) in errors.items():
                print(
                    f"{name:6s} N=1024: relative Frobenius error dhidden {e_h:.3g} "
                    f"dweight {e_w:.3g}"
                )
            verdicts.append(
                (
                    "accuracy <= 1.5x eager's",
                    errors["ours"][0] <= 1.5 * errors["eager"][0]
                    and errors["ours"][1] <= 1.5 * errors["eager"][1],
                )
            )
        del hidden, targets, a
        torch.cuda.empty_cache()
    if args.profile:
        n = args.profile
        hidden = torch.randn((n, H), device="cuda", generator=gen).bfloat16()
        targets = torch.randint(0, V, (n,), device="cuda", generator=gen, dtype=torch.int32)
        a = torch.rand((n,), device="cuda", generator=gen)
        profile_kernels(lambda: ours(hidden, weight, targets, a), f"ours N={n}")
    for what, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'} {what}")
    return 0 if all(ok for _, ok in verdicts) else 1  # a FAIL line fails the run


if __name__ == "__main__":
    raise SystemExit(main())
