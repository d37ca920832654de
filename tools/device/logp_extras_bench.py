"""Entropy and top-k cost of the fused linear-logp kernel.

Runs on a GPU host with the bundle (tools/device/bundle.sh) and PyTorch: for each N, the logp-only kernel, + entropy, + top_k=20 and both,
timed interleaved (CUDA events, median), beside PyTorch eager computing the
same three outputs from materialised fp32 logits. Also checks that extras
leave logprob/lse bits alone and measures accuracy against float64 on a few
rows. FLOPs are counted as 2*N*H*V for every variant.

  python3 tools/device/logp_extras_bench.py [--lib .../liblogp_bench.so]

--kernel=portable measures the portable mma.sync kernel, forced.
"""

import ctypes
import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logp_bench import ClockSampler, bench_arguments, median_ms_interleaved  # noqa: E402
from timing import median_ms  # noqa: E402

TOP_K = 20
VARIANTS = (
    ("logp", False, 0),
    ("entropy", True, 0),
    ("top20", False, TOP_K),
    ("both", True, TOP_K),
)


def load(lib_path):
    lib = ctypes.CDLL(lib_path)
    lib.logp_create.restype = ctypes.c_void_p
    lib.logp_create.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_longlong,
        ctypes.c_longlong,
        ctypes.c_longlong,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.logp_workspace_bytes_extras.restype = ctypes.c_ulonglong
    lib.logp_workspace_bytes_extras.argtypes = [
        ctypes.c_void_p,
        ctypes.c_longlong,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.logp_version.restype = ctypes.c_char_p
    lib.logp_launch_extras.restype = ctypes.c_int
    lib.logp_launch_extras.argtypes = (
        [ctypes.c_void_p] * 7
        + [ctypes.c_int]
        + [ctypes.c_void_p] * 2
        + [ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p]
    )
    return lib


def reference(hidden, W, bias, temps, rows):
    """float64 entropy and ranking of `rows`."""
    z = (hidden[rows].double() @ W.double().T + bias.double()) / temps[rows].double()[:, None]
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    logp = z - lse
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy, logp


def time_in_blocks(fns, reps, warmup_ms):
    """Each function alone: launched back to back for warmup_ms, then `reps`
    timed launches (median, min, max ms) with the SM clock and power sampled
    meanwhile. Returns the timings and the clock summaries, in fns' order."""
    timed, clocks = [], []
    for fn in fns:
        end = time.monotonic() + warmup_ms / 1e3
        while time.monotonic() < end:
            fn()
            torch.cuda.synchronize()
        with ClockSampler() as sampler:
            timed.append(median_ms(fn, reps, warmup=0))
        clocks.append(sampler.summary())
    return timed, clocks


def main():
    ap = bench_arguments()
    ap.add_argument("--kernel", choices=("hopper", "portable"), default="hopper")
    ap.add_argument(
        "--no-torch",
        action="store_true",
        help="skip the PyTorch eager baseline (build against build)",
    )
    ap.add_argument(
        "--seed", type=int, default=None, help="fixed inputs, so that two builds' digests compare"
    )
    ap.add_argument(
        "--timing",
        choices=("interleaved", "blocks"),
        default="interleaved",
        help="interleaved: the variants alternate launch by launch (each "
        "starts at the clock the one before left; --gap-ms idles "
        "first); blocks: each variant runs alone, back to back, for "
        "--block-warmup-ms before its timed launches, so that each is "
        "timed at the clock its own power draw settles at (the H200 "
        "runs at its power cap at N >= 1024), with the SM clock and "
        "power sampled per variant",
    )
    ap.add_argument("--block-warmup-ms", type=float, default=500.0)
    args = ap.parse_args()

    lib = load(args.lib)
    version = lib.logp_version().decode() if args.kernel == "hopper" else "portable"
    H, V, Vp = args.hidden, args.vocab, args.padded_vocab
    dev = torch.device("cuda")
    torch.manual_seed(torch.seed() if args.seed is None else args.seed)
    W = (torch.randn(Vp, H, device=dev) * 0.02).to(torch.bfloat16)
    bias = torch.randn(Vp, device=dev) * 0.1
    mode = 0 if args.kernel == "hopper" else 2
    handle = lib.logp_create(W.data_ptr(), bias.data_ptr(), H, V, Vp, mode, 0)
    if not handle:
        sys.exit("logp_create failed")
    stream = torch.cuda.current_stream().cuda_stream
    print(
        f"device {torch.cuda.get_device_name()}; kernel {version}; "
        f"H={H} V={V} Vpad={Vp}; top_k={TOP_K}",
        flush=True,
    )

    rows_out = []
    failures = 0
    for n in [int(x) for x in args.ns.split(",")]:
        hidden = torch.randn(n, H, device=dev).to(torch.bfloat16)
        targets = torch.randint(0, V, (n,), device=dev, dtype=torch.int32)
        temps = torch.rand(n, device=dev) * 1.5 + 0.5
        rec = {"n": n, "flops": 2.0 * n * H * V}
        fns, outs = [], {}
        for name, entropy, k in VARIANTS:
            ws_bytes = lib.logp_workspace_bytes_extras(handle, n, int(entropy), k)
            ws = torch.empty(max(ws_bytes, 1), device=dev, dtype=torch.uint8)
            lp = torch.full((n,), float("nan"), device=dev)
            lse = torch.full((n,), float("nan"), device=dev)
            ent = torch.full((n,), float("nan"), device=dev)
            top_ids = torch.full((n, max(k, 1)), -7, device=dev, dtype=torch.int32)
            top_lp = torch.full((n, max(k, 1)), float("nan"), device=dev)

            def run(
                entropy=entropy, k=k, ws=ws, lp=lp, lse=lse, ent=ent, top_ids=top_ids, top_lp=top_lp
            ):
                rc = lib.logp_launch_extras(
                    handle,
                    hidden.data_ptr(),
                    targets.data_ptr(),
                    temps.data_ptr(),
                    lp.data_ptr(),
                    lse.data_ptr(),
                    ent.data_ptr() if entropy else None,
                    k,
                    top_ids.data_ptr(),
                    top_lp.data_ptr(),
                    n,
                    ws.data_ptr(),
                    stream,
                )
                if rc != 0:
                    raise RuntimeError("logp_launch_extras failed")

            run()
            fns.append(run)
            outs[name] = (lp, lse, ent, top_ids, top_lp)
            rec[f"{name}_workspace_bytes_per_row"] = ws_bytes / n
        torch.cuda.synchronize()

        base_lp, base_lse = outs["logp"][0], outs["logp"][1]
        for name in ("entropy", "top20", "both"):
            same = torch.equal(
                outs[name][0].view(torch.int32), base_lp.view(torch.int32)
            ) and torch.equal(outs[name][1].view(torch.int32), base_lse.view(torch.int32))
            rec[f"{name}_same_logp_bits"] = same
            if not same:
                failures += 1
                print(f"FAIL N={n}: {name} changed logprob/lse bits", flush=True)
        # A row's top-k is the same with or without entropy beside it.
        same_top = torch.equal(outs["top20"][3], outs["both"][3]) and torch.equal(
            outs["top20"][4].view(torch.int32), outs["both"][4].view(torch.int32)
        )
        rec["top20_same_top_k_bits_as_both"] = same_top
        if not same_top:
            failures += 1
            print(f"FAIL N={n}: top20's top-k differs from both's", flush=True)
        # The extras' bits, to compare builds run with the same --seed.
        digest = hashlib.sha256()
        for t in outs["both"]:
            digest.update(t.cpu().numpy().tobytes())
        rec["both_digest"] = digest.hexdigest()[:16]
        # Accuracy vs float64 on a few rows.
        sel = sorted(set([0, n // 2, n - 1]))
        ref_ent, ref_logp = reference(hidden, W[:V], bias[:V], temps, sel)
        _, _, ent, top_ids, top_lp = outs["both"]
        rec["entropy_err"] = (ent[sel].double() - ref_ent).abs().max().item()
        ranked, order = ref_logp.sort(dim=-1, descending=True, stable=True)
        top_err, id_mismatch = 0.0, 0
        for i, r in enumerate(sel):
            for j in range(TOP_K):
                gap_before = ranked[i, j - 1] - ranked[i, j] if j else 1.0
                gap_after = ranked[i, j] - ranked[i, j + 1]
                if (
                    gap_before > 1e-4
                    and gap_after > 1e-4
                    and int(top_ids[r, j]) != int(order[i, j])
                ):
                    id_mismatch += 1
                top_err = max(top_err, abs(float(top_lp[r, j]) - float(ranked[i, j])))
        rec["top_logprob_err"] = top_err
        rec["top_id_mismatches"] = id_mismatch
        if rec["entropy_err"] > 2e-3 or top_err > 1e-3 or id_mismatch:
            failures += 1
            print(f"FAIL N={n}: accuracy {rec}", flush=True)

        if args.timing == "interleaved":
            timed = median_ms_interleaved(fns, args.reps, gap_ms=args.gap_ms)
            clocks = [""] * len(fns)
        else:
            timed, clocks = time_in_blocks(fns, args.reps, args.block_warmup_ms)
        for (name, _, _), (ms, lo, hi), clock in zip(VARIANTS, timed, clocks):
            rec[f"{name}_ms"] = ms
            rec[f"{name}_spread"] = (lo, hi)
            if clock:
                rec[f"{name}_clocks"] = clock
                print(f"  N={n} {name}: {ms:.4f} ms, {clock}", flush=True)
        del outs, fns

        def torch_fn():
            logits = torch.nn.functional.linear(hidden, W[:V]).float()
            logits += bias[:V]
            logits /= temps[:, None]
            logp_all = torch.log_softmax(logits, dim=-1)
            lp = logp_all.gather(1, targets[:, None].long()).squeeze(1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            top = logp_all.topk(TOP_K, dim=-1)
            return lp, entropy, top

        if n <= 4096 and not args.no_torch:  # 8192 x 151936 fp32: ~10 GB
            rec["torch_ms"], _, _ = median_ms(torch_fn, args.reps)
        rows_out.append(rec)
        b = rec["logp_ms"]
        print(
            f"N={n}: logp {b:.4f} ms, +entropy {100 * (rec['entropy_ms'] / b - 1):+.1f}%, "
            f"+top20 {100 * (rec['top20_ms'] / b - 1):+.1f}%, "
            f"both {100 * (rec['both_ms'] / b - 1):+.1f}%, "
            f"torch eager {rec.get('torch_ms', float('nan')):.4f} ms; "
            f"entropy err {rec['entropy_err']:.1e}, top err {top_err:.1e}; "
            f"outputs digest {rec['both_digest']}",
            flush=True,
        )
        del hidden

    print()
    print(
        f"{'N':>5} {'logp ms':>9} {'TFLOP/s':>8} {'ent ms':>9} {'ent +%':>7}"
        f" {'top20 ms':>9} {'top +%':>7} {'both ms':>9} {'both +%':>7}"
        f" {'torch ms':>9} {'x torch':>7} {'ws B/row both':>13}"
    )
    for r in rows_out:
        b = r["logp_ms"]
        tf = r["flops"] / (b * 1e-3) / 1e12
        print(
            f"{r['n']:>5} {b:>9.4f} {tf:>8.1f} {r['entropy_ms']:>9.4f}"
            f" {100 * (r['entropy_ms'] / b - 1):>6.1f}% {r['top20_ms']:>9.4f}"
            f" {100 * (r['top20_ms'] / b - 1):>6.1f}% {r['both_ms']:>9.4f}"
            f" {100 * (r['both_ms'] / b - 1):>6.1f}%"
            f" {r.get('torch_ms', float('nan')):>9.4f}"
            f" {r.get('torch_ms', float('nan')) / r['both_ms']:>7.2f}"
            f" {r['both_workspace_bytes_per_row']:>13.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": version, "rows": rows_out}, f, indent=1)
    print(f"extras bench: {'PASS' if failures == 0 else f'FAIL ({failures})'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
