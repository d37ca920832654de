"""The trainer's twin in a training step: forward + backward of
`detlogp.torch.linear_logp` beside PyTorch eager and torch.compile of the
same eager expression, at H = 4096, V = 151936, bf16, loss sum_i a_i * logp_i
with random per-row weights a_i (no bias, temperature 1).

  twin      detlogp.torch.linear_logp(h, W, t) -> autograd (the served
            forward + the fused backward)
  eager     logits = h @ W^T (bf16) -> float -> log_softmax -> gather,
            autograd
  compiled  torch.compile of eager's loss expression, autograd

Each method's gradients are fresh tensors every call (no accumulation). For
each N: fresh random inputs, one warm-up call per method, then --repeats
rounds with the methods interleaved (one CUDA-event timing each), the median
reported; peak memory above what was allocated before the call (the
gradients' own bytes included), and the same plus the weight, as the trainer
sees it.

Checks, at --check_rows rows (printed PASS/FAIL lines, then the digests a
second library build must reproduce to claim the same bits):
  * a row's d hidden bits are the same alone (in a batch of 8) and in the
    batch;
  * two calls give the same d weight bits;
  * relative Frobenius error of d hidden (every 8th row) and d weight vs
    float64, twin <= 1.5 x eager's;
  * SHA-256 of the forward's logprobs, of d hidden and of d weight.

With --profile N: GPU time per kernel of one twin call at N (torch.profiler).

Usage: python3 tools/device/twin_train_bench.py [--sizes 1024,4096,8192,16384]
         [--repeats 5] [--methods twin,eager,compiled] [--profile 16384]
The libraries are found as detlogp.ops finds them ($DETLOGP_OPS_CUDA_LIBRARY
first), so one script times several builds of the backward, one process each.
"""

import argparse
import hashlib
import statistics

import detlogp.torch as dt
import torch

H, V = 4096, 151936


def eager_loss(h, w, t, a):
    logits = (h @ w.t()).float()
    logp = torch.log_softmax(logits, dim=-1).gather(1, t[:, None].long())[:, 0]
    return (a * logp).sum()


def twin_loss(h, w, t, a):
    return (a * dt.linear_logp(h, w, t)).sum()


def step(loss_fn):
    def run(hidden, weight, targets, a):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        loss_fn(h, w, targets, a).backward()
        return h.grad, w.grad

    return run


def digest(t):
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy()).hexdigest()[:16]


def peak_bytes(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def float64_grads(hidden, weight, targets, a, rows):
    h = hidden.double()
    z = h @ weight.double().t()
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    g = -torch.exp(z - lse) * a.double()[:, None]
    g[torch.arange(len(targets)), targets.long()] += a.double()
    return g[rows] @ weight.double(), g.t() @ h


def rel_error(got, want):
    return (torch.linalg.norm(got.double() - want) / torch.linalg.norm(want)).item()


def checks(methods, weight, n, gen):
    hidden = torch.randn((n, H), device="cuda", generator=gen).bfloat16()
    targets = torch.randint(0, V, (n,), device="cuda", generator=gen, dtype=torch.int32)
    a = torch.rand((n,), device="cuda", generator=gen)
    twin = methods["twin"]
    verdicts = []
    dh, dw = twin(hidden, weight, targets, a)
    dh2, dw2 = twin(hidden, weight, targets, a)
    verdicts.append(
        (
            "d weight and d hidden the same bits in two calls",
            torch.equal(dw.view(torch.int16), dw2.view(torch.int16))
            and torch.equal(dh.view(torch.int16), dh2.view(torch.int16)),
        )
    )
    invariant = True
    for r0 in (0, n // 2 + 3, n - 8):
        sh, _ = twin(
            hidden[r0 : r0 + 8].contiguous(),
            weight,
            targets[r0 : r0 + 8].contiguous(),
            a[r0 : r0 + 8].contiguous(),
        )
        invariant &= torch.equal(sh.view(torch.int16), dh[r0 : r0 + 8].view(torch.int16))
    verdicts.append(("d hidden of 8 rows alone == the same rows in the batch", invariant))
    logp = dt.linear_logp(hidden, weight, targets)
    print(f"digests N={n}: logp {digest(logp)} dhidden {digest(dh)} dweight {digest(dw)}")
    rows = torch.arange(0, n, 8, device="cuda")
    want_h, want_w = float64_grads(hidden, weight, targets, a, rows)
    errors = {}
    for name in ("twin", "eager"):
        gh, gw = methods[name](hidden, weight, targets, a)
        errors[name] = (rel_error(gh[rows], want_h), rel_error(gw, want_w))
        print(
            f"{name:8s} N={n}: error vs float64 d hidden {errors[name][0]:.3e} "
            f"d weight {errors[name][1]:.3e}"
        )
    verdicts.append(
        (
            "error <= 1.5 x eager's",
            all(errors["twin"][i] <= 1.5 * errors["eager"][i] for i in range(2)),
        )
    )
    return verdicts


def profile(fn, label):
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1024,4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--methods", default="twin,eager,compiled")
    parser.add_argument("--check_rows", type=int, default=1024)
    parser.add_argument("--profile", default="")
    parser.add_argument("--label", default="twin")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    all_methods = {
        "twin": step(twin_loss),
        "eager": step(eager_loss),
        "compiled": step(torch.compile(eager_loss)),
    }
    names = [m for m in args.methods.split(",") if m]
    gen = torch.Generator(device="cuda").manual_seed(49)
    weight = (torch.randn((V, H), device="cuda", generator=gen) * 0.02).bfloat16()
    weight_bytes = weight.numel() * weight.element_size()
    verdicts = []
    if args.check_rows:
        verdicts += checks(all_methods, weight, args.check_rows, gen)
    results = {}
    for n in [int(s) for s in args.sizes.split(",") if s]:
        hidden = torch.randn((n, H), device="cuda", generator=gen).bfloat16()
        targets = torch.randint(0, V, (n,), device="cuda", generator=gen, dtype=torch.int32)
        a = torch.rand((n,), device="cuda", generator=gen)
        call = {m: (lambda fn=all_methods[m]: fn(hidden, weight, targets, a)) for m in names}
        for m in names:
            call[m]()
        torch.cuda.synchronize()
        times = {m: [] for m in names}
        for _ in range(args.repeats):
            for m in names:
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                out = call[m]()
                stop.record()
                stop.synchronize()
                del out
                times[m].append(start.elapsed_time(stop))
        for m in names:
            ms = statistics.median(times[m])
            extra = peak_bytes(call[m])
            results[(m, n)] = (ms, extra)
            tflops = 8 * n * H * V / (ms * 1e-3) / 1e12
            spread = (max(times[m]) - min(times[m])) / ms
            print(
                f"{args.label if m == 'twin' else m:10s} N={n:6d}: {ms:8.2f} ms "
                f"(spread {100 * spread:4.1f}%) {tflops:6.1f} TFLOP/s(8NHV)  peak "
                f"{extra / 2**30:6.2f} GiB above inputs, {(extra + weight_bytes) / 1e9:6.2f} GB "
                f"with W",
                flush=True,
            )
        del hidden, targets, a, call
        torch.cuda.empty_cache()
    for n in sorted({n for _, n in results}):
        if ("twin", n) in results and ("eager", n) in results:
            tw, ea = results[("twin", n)], results[("eager", n)]
            line = f"ratio N={n:6d}: twin/eager time {tw[0] / ea[0]:.3f} memory {tw[1] / ea[1]:.3f}"
            if ("compiled", n) in results:
                line += f"  twin/compiled time {tw[0] / results[('compiled', n)][0]:.3f}"
            print(line)
    for n in [int(s) for s in args.profile.split(",") if s]:
        hidden = torch.randn((n, H), device="cuda", generator=gen).bfloat16()
        targets = torch.randint(0, V, (n,), device="cuda", generator=gen, dtype=torch.int32)
        a = torch.rand((n,), device="cuda", generator=gen)
        profile(lambda: all_methods["twin"](hidden, weight, targets, a), f"{args.label} N={n}")
        del hidden, targets, a
    for what, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'} {what}")
    return 0 if all(ok for _, ok in verdicts) else 1  # a FAIL line fails the run


if __name__ == "__main__":
    raise SystemExit(main())
