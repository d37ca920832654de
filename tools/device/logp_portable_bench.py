"""Speed of the portable mma.sync linear-logp kernel on this GPU,
forced, beside the Hopper kernel and PyTorch eager in the same run.

Runs on a GPU host with the bundle (tools/device/bundle.sh):
for each N, the portable and Hopper kernels (batch-invariant splits) timed
interleaved with CUDA events (median), then the portable kernel alone (back
to back: "alone"), PyTorch eager's logprob (bf16 matmul, fp32 log-softmax,
gather) after them; FLOPs counted 2*N*H*V; the weight-read
floor from a device copy of the weight measured in the same run.

  python3 tools/device/logp_portable_bench.py [--lib .../liblogp_bench.so] \
      [--rlkernel DIR]

--rlkernel adds RL-Kernel's mma.sync kernel (DIR holds its two sources,
see rlkernel_baseline.py; built here with PyTorch's extension builder, about a minute),
timed back to back after ours at temperature 1 with the same weights and
bias, its logprobs checked against PyTorch eager's; "port/rlk" is the
portable kernel's speed over it (the target: >= 1.8 at N >= 2048).

Inputs come from a fixed seed, and each line ends with digests of the
portable and the Hopper kernels' logprobs and lse: two builds that print the
same digests give the same bits (how a build that only retunes a kernel's
schedule, or moves its code, shows it kept the kernel version's bits).
"""

import ctypes
import hashlib
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logp_bench import ClockSampler, bench_arguments, median_ms_interleaved  # noqa: E402
from timing import median_ms  # noqa: E402

KERNELS = (("portable", 2), ("hopper", 0))


def main():
    ap = bench_arguments()
    ap.add_argument(
        "--rlkernel", default=None, help="RL-Kernel's sources (see rlkernel_baseline.py)"
    )
    ap.add_argument(
        "--portable-row-group",
        type=int,
        default=0,
        help="the portable kernel's item order (LinearLogpCuda::"
        "Options::row_group; 0: the default; never changes bits)",
    )
    args = ap.parse_args()
    rlkernel = None
    if args.rlkernel:
        from rlkernel_baseline import load as load_rlkernel

        rlkernel = load_rlkernel(args.rlkernel)
    lib = ctypes.CDLL(args.lib)
    lib.logp_create_tuned.restype = ctypes.c_void_p
    lib.logp_create_tuned.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_longlong,
        ctypes.c_longlong,
        ctypes.c_longlong,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.logp_workspace_bytes.restype = ctypes.c_ulonglong
    lib.logp_workspace_bytes.argtypes = [ctypes.c_void_p, ctypes.c_longlong]
    lib.logp_launch.restype = ctypes.c_int
    lib.logp_launch.argtypes = [ctypes.c_void_p] * 6 + [
        ctypes.c_longlong,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    H, V, Vp = args.hidden, args.vocab, args.padded_vocab
    dev = torch.device("cuda")
    # The Hopper kernel beside it only where it runs (compute capability 9.0).
    kernels = KERNELS if torch.cuda.get_device_capability(dev) == (9, 0) else KERNELS[:1]
    torch.manual_seed(13)
    W = (torch.randn(Vp, H, device=dev) * 0.02).to(torch.bfloat16)
    bias = torch.randn(Vp, device=dev) * 0.1
    handles = {}
    for name, mode in kernels:
        group = args.portable_row_group if name == "portable" else 0
        handles[name] = lib.logp_create_tuned(
            W.data_ptr(), bias.data_ptr(), H, V, Vp, mode, 0, group, group
        )
        if not handles[name]:
            sys.exit(f"logp_create failed for the {name} kernel")
    dst = torch.empty(V, H, device=dev, dtype=torch.bfloat16)
    copy_ms, _, _ = median_ms(lambda: dst.copy_(W[:V]), args.reps)
    del dst
    floor_ms = copy_ms / 2.0
    stream = torch.cuda.current_stream().cuda_stream
    print(
        f"{torch.cuda.get_device_name()}; H={H} V={V}; weight-read floor {floor_ms:.4f} ms",
        flush=True,
    )
    print(
        f"{'N':>5} {'portable ms':>11} {'TFLOP/s':>8} {'x floor':>7} {'hopper ms':>9}"
        f" {'TFLOP/s':>8} {'port/hop':>8} {'eager ms':>9} {'TFLOP/s':>8} {'port/eager':>10}"
        f" {'alone ms':>8} {'TFLOP/s':>8}"
    )
    rows_out = []
    for n in [int(x) for x in args.ns.split(",")]:
        hidden = torch.randn(n, H, device=dev).to(torch.bfloat16)
        targets = torch.randint(0, V, (n,), device=dev, dtype=torch.int32)
        temps = torch.rand(n, device=dev) * 1.5 + 0.5
        fns, outs = [], []
        for name, _ in kernels:
            h = handles[name]
            ws = torch.empty(max(lib.logp_workspace_bytes(h, n), 1), device=dev, dtype=torch.uint8)
            lp = torch.empty(n, device=dev)
            lse = torch.empty(n, device=dev)

            def run(h=h, ws=ws, lp=lp, lse=lse):
                if lib.logp_launch(
                    h,
                    hidden.data_ptr(),
                    targets.data_ptr(),
                    temps.data_ptr(),
                    lp.data_ptr(),
                    lse.data_ptr(),
                    n,
                    ws.data_ptr(),
                    stream,
                ):
                    raise RuntimeError("logp_launch failed")

            run()
            fns.append(run)
            outs.append((lp, lse))
        torch.cuda.synchronize()
        err = (outs[0][0] - outs[-1][0]).abs().max().item()
        digests = [
            hashlib.sha256(lp.cpu().numpy().tobytes() + lse.cpu().numpy().tobytes()).hexdigest()[
                :12
            ]
            for lp, lse in outs
        ]
        with ClockSampler() as interleaved_clocks:
            timed = median_ms_interleaved(fns, args.reps, gap_ms=args.gap_ms)
        p_ms = timed[0][0]
        h_ms = timed[1][0] if len(timed) > 1 else float("nan")
        # The portable kernel timed back to back, as a user of it runs it: the
        # interleaved Hopper kernel draws more power and may leave the clocks
        # lower for the next launch.
        with ClockSampler() as alone_clocks:
            alone_ms = median_ms(fns[0], args.reps)[0]

        def eager():
            logits = F.linear(hidden, W[:V]).float()
            logits += bias[:V]
            logits /= temps[:, None]
            return logits.gather(1, targets[:, None].long()).squeeze(1) - torch.logsumexp(
                logits, dim=-1
            )

        e_ms = median_ms(eager, args.reps)[0] if n <= 4096 else float("nan")
        flops = 2.0 * n * H * V
        tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        rlk_line = ""
        if rlkernel is not None:
            W_real, bias_real = W[:V], bias[:V]

            def rlk():
                return rlkernel(hidden, W_real, targets, bias_real)

            rlk_lp = rlk()[0]
            at_t1 = F.linear(hidden, W_real).float() + bias_real
            ref = at_t1.gather(1, targets[:, None].long()).squeeze(1) - torch.logsumexp(
                at_t1, dim=-1
            )
            rlk_err = (rlk_lp - ref).abs().max().item()
            del at_t1
            rlk_ms = median_ms(rlk, args.reps)[0]
            rlk_line = (
                f"   rlk ms {rlk_ms:.4f} TFLOP/s {tf(rlk_ms):.1f} port/rlk "
                f"{rlk_ms / alone_ms:.2f} |rlk - eager(T=1)| {rlk_err:.1e}"
            )
        print(
            f"{n:>5} {p_ms:>11.4f} {tf(p_ms):>8.1f} {p_ms / floor_ms:>7.2f} {h_ms:>9.4f}"
            f" {tf(h_ms):>8.1f} {p_ms / h_ms:>8.2f} {e_ms:>9.4f} {tf(e_ms):>8.1f}"
            f" {e_ms / p_ms:>10.2f} {alone_ms:>8.4f} {tf(alone_ms):>8.1f}"
            f"   |portable - hopper| {err:.1e}  bits {digests[0]}"
            f" hopper bits {digests[-1] if len(digests) > 1 else '-'}{rlk_line}",
            flush=True,
        )
        print(
            f"      clocks interleaved (gap {args.gap_ms:g} ms): "
            f"{interleaved_clocks.summary()}; back to back: {alone_clocks.summary()}",
            flush=True,
        )
        rows_out.append(
            {
                "n": n,
                "portable_ms": p_ms,
                "hopper_ms": None if len(kernels) == 1 else h_ms,
                "alone_ms": alone_ms,
                "eager_ms": None if e_ms != e_ms else e_ms,
                "portable_digest": digests[0],
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            result = {"device": torch.cuda.get_device_name(), "floor_ms": floor_ms}
            json.dump({**result, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
