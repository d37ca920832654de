"""The Hopper kernel's item order (kernels/item_order.h) as a tuning knob:
for each N, the logp-only and top-20 launches at each row-block group,
timed interleaved (CUDA events, median), with every group's logprob, lse,
top ids and top logprobs checked bit for bit against the default group's
(item order must never change bits).

  python3 tools/device/logp_row_group_bench.py \\
      --groups 8,16,32 --ns 1024,2048,4096,8192

A larger group puts fewer of a row's splits side by side (the top-k
variant's shared screens tighten sooner: docs/kernels.md, top-k)
and reads each split's weights once for more row blocks.
"""

import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logp_bench import bench_arguments, median_ms_interleaved  # noqa: E402
from logp_extras_bench import load  # noqa: E402

TOP_K = 20


def main():
    ap = bench_arguments()
    ap.add_argument("--groups", default="8,16,32")
    ap.add_argument("--seed", type=int, default=8)
    args = ap.parse_args()
    lib = load(args.lib)
    lib.logp_create_tuned.restype = ctypes.c_void_p
    lib.logp_create_tuned.argtypes = (
        [ctypes.c_void_p] * 2 + [ctypes.c_longlong] * 3 + [ctypes.c_int] * 4
    )
    H, V, Vp = args.hidden, args.vocab, args.padded_vocab
    dev = torch.device("cuda")
    torch.manual_seed(args.seed)
    W = (torch.randn(Vp, H, device=dev) * 0.02).to(torch.bfloat16)
    bias = torch.randn(Vp, device=dev) * 0.1
    groups = [int(g) for g in args.groups.split(",")]
    handles = {}
    for g in groups:
        handles[g] = lib.logp_create_tuned(W.data_ptr(), bias.data_ptr(), H, V, Vp, 0, 0, g, g)
        if not handles[g]:
            sys.exit(f"logp_create_tuned failed for group {g}")
    stream = torch.cuda.current_stream().cuda_stream
    failures = 0
    print(f"{torch.cuda.get_device_name()}; H={H} V={V}; groups {groups}; top_k={TOP_K}")
    for n in [int(x) for x in args.ns.split(",")]:
        hidden = torch.randn(n, H, device=dev).to(torch.bfloat16)
        targets = torch.randint(0, V, (n,), device=dev, dtype=torch.int32)
        temps = torch.rand(n, device=dev) * 1.5 + 0.5
        fns, outs, labels = [], [], []
        for g in groups:
            for k in (0, TOP_K):
                h = handles[g]
                ws = torch.empty(
                    max(lib.logp_workspace_bytes_extras(h, n, 0, k), 1),
                    device=dev,
                    dtype=torch.uint8,
                )
                out = (
                    torch.empty(n, device=dev),
                    torch.empty(n, device=dev),
                    torch.empty(n, max(k, 1), device=dev, dtype=torch.int32),
                    torch.empty(n, max(k, 1), device=dev),
                )

                def run(h=h, k=k, ws=ws, out=out):
                    if lib.logp_launch_extras(
                        h,
                        hidden.data_ptr(),
                        targets.data_ptr(),
                        temps.data_ptr(),
                        out[0].data_ptr(),
                        out[1].data_ptr(),
                        None,
                        k,
                        out[2].data_ptr(),
                        out[3].data_ptr(),
                        n,
                        ws.data_ptr(),
                        stream,
                    ):
                        raise RuntimeError("logp_launch_extras failed")

                run()
                fns.append(run)
                outs.append(out)
                labels.append((g, k))
        torch.cuda.synchronize()
        reference = {k: outs[labels.index((groups[0], k))] for k in (0, TOP_K)}
        for (g, k), out in zip(labels, outs):
            tensors = out if k else out[:2]
            same = all(
                torch.equal(a.view(torch.int32), b.view(torch.int32))
                for a, b in zip(tensors, reference[k])
            )
            if not same:
                failures += 1
                print(f"FAIL N={n}: group {g}, top_k {k} changed bits", flush=True)
        timed = dict(zip(labels, median_ms_interleaved(fns, args.reps)))
        base = timed[(groups[0], 0)][0]
        for g in groups:
            logp_ms, top_ms = timed[(g, 0)][0], timed[(g, TOP_K)][0]
            tf = 2.0 * n * H * V / (logp_ms * 1e-3) / 1e12
            print(
                f"N={n:>5} group {g:>3}: logp {logp_ms:.4f} ms ({tf:.1f} TFLOP/s, "
                f"{100 * (logp_ms / base - 1):+.1f}% vs group {groups[0]}), top20 "
                f"{top_ms:.4f} ms ({100 * (top_ms / base - 1):+.1f}% over group "
                f"{groups[0]}'s logp-only, {100 * (top_ms / logp_ms - 1):+.1f}% over its own)",
                flush=True,
            )
        del hidden, outs, fns
    print(f"row-group bench: {'PASS' if failures == 0 else f'FAIL ({failures})'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
