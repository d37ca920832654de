#!/usr/bin/env python3
"""Benchmark of the CUDA fused linear-logp kernel against PyTorch eager and the
weight-read floor, all measured in one run on a GPU host.

  PyTorch eager: cuBLAS bf16 matmul -> fp32 (+bias, /T) -> logsumexp -> gather.
  floor: a device-to-device copy of the weight's bytes; the floor for reading
         the weight once is half the copy time (a copy reads and writes).
  ours:  liblogp_bench.so (tools/device/logp_bench_lib.cu, built by
         tools/device/bundle.sh) through ctypes, in
         the batch-invariant split and the throughput-tuned split.

Every timing is the median of --reps timed runs (CUDA events) after warm-up,
on fresh random data (hidden ~ N(0,1), W ~ N(0, 0.02^2), bias ~ N(0, 0.1^2)).
Prints a table last; --json writes the numbers.
"""

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from bundle_paths import bundle_lib
from timing import median_ms


def gpu_state():
    """SM clock and power right after a measurement (throttling shows here)."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out
    except Exception as e:  # noqa: BLE001 - informational only
        return f"n/a ({e})"


def median_ms_interleaved(fns, reps, warmup=3, gap_ms=0.0):
    """Times several functions alternately (A B A B ...; the order flips every
    rep) so that clock and power drift hit them alike. gap_ms > 0 leaves the
    GPU idle that long before each launch, so that one function's power draw
    does not set the clocks the next one starts at. Returns a list of
    (median, min, max) per function."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for r in range(reps):
        order = list(range(len(fns)))
        if r % 2:
            order.reverse()
        for i in order:
            if gap_ms > 0:
                time.sleep(gap_ms / 1e3)
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fns[i]()
            b.record()
            b.synchronize()
            times[i].append(a.elapsed_time(b))
    return [(statistics.median(t), min(t), max(t)) for t in times]


def bench_arguments():
    """The arguments every linear-logp bench takes: library, shape, N, reps."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=bundle_lib("liblogp_bench.so"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--padded-vocab", type=int, default=152064)
    ap.add_argument("--ns", default="1,16,64,256,1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle time before each interleaved launch (0: none)",
    )
    return ap


class ClockSampler:
    """nvidia-smi sampling SM clock and power every `period_ms` while the
    block runs; summary() gives min / median / max of each."""

    def __init__(self, period_ms=10):
        self.period_ms = period_ms
        self.lines = []

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=clocks.sm,power.draw",
                    "--format=csv,noheader,nounits",
                    f"-lms={self.period_ms}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return False
        self.proc.terminate()
        out, _ = self.proc.communicate()
        self.lines = [line.split(",") for line in out.splitlines() if "," in line]
        return False

    def summary(self):
        if not self.lines:
            return "no clock samples"
        clocks = sorted(float(c) for c, _ in self.lines)
        power = sorted(float(p) for _, p in self.lines)
        return (
            f"SM MHz {clocks[0]:.0f}/{statistics.median(clocks):.0f}/{clocks[-1]:.0f}, "
            f"W {power[0]:.0f}/{statistics.median(power):.0f}/{power[-1]:.0f} "
            f"(min/median/max of {len(clocks)} samples)"
        )


def main():
    ap = bench_arguments()
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()

    lib = ctypes.CDLL(args.lib)
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
    lib.logp_workspace_bytes.restype = ctypes.c_ulonglong
    lib.logp_workspace_bytes.argtypes = [ctypes.c_void_p, ctypes.c_longlong]
    lib.logp_num_splits.restype = ctypes.c_int
    lib.logp_num_splits.argtypes = [ctypes.c_void_p, ctypes.c_longlong]
    lib.logp_version.restype = ctypes.c_char_p
    lib.logp_launch.restype = ctypes.c_int
    lib.logp_launch.argtypes = [ctypes.c_void_p] * 6 + [
        ctypes.c_longlong,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    version = lib.logp_version().decode()

    H, V, Vp = args.hidden, args.vocab, args.padded_vocab
    dev = torch.device("cuda")
    torch.manual_seed(torch.seed())
    W = (torch.randn(Vp, H, device=dev) * 0.02).to(torch.bfloat16)
    bias = torch.randn(Vp, device=dev) * 0.1
    props = torch.cuda.get_device_properties(dev)
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs; "
        f"kernel {version}; H={H} V={V} Vpad={Vp}",
        flush=True,
    )

    # Ceilings measured in this run.
    wbytes = V * H * 2
    dst = torch.empty(V, H, device=dev, dtype=torch.bfloat16)
    copy_ms, _, _ = median_ms(lambda: dst.copy_(W[:V]), args.reps)
    del dst
    floor_ms = copy_ms / 2.0
    bw = 2 * wbytes / (copy_ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    bm = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    mm_ms, _, _ = median_ms(lambda: a @ bm, args.reps)
    peak_tflops = 2 * 8192**3 / (mm_ms * 1e-3) / 1e12
    del a, bm
    print(
        f"weight copy {copy_ms:.4f} ms -> {bw:.2f} TB/s (read+write); "
        f"weight-read floor {floor_ms:.4f} ms; cuBLAS 8192^3 bf16 "
        f"{peak_tflops:.0f} TFLOP/s",
        flush=True,
    )

    handles = {}
    for name, mode in (("invariant", 0), ("throughput", 1)):
        h = lib.logp_create(W.data_ptr(), bias.data_ptr(), H, V, Vp, mode, 0)
        if not h:
            sys.exit("logp_create failed")
        handles[name] = h

    rows_out = []
    for n in [int(x) for x in args.ns.split(",")]:
        hidden = torch.randn(n, H, device=dev).to(torch.bfloat16)
        targets = torch.randint(0, V, (n,), device=dev, dtype=torch.int32)
        temps = torch.rand(n, device=dev) * 1.5 + 0.5
        flops = 2.0 * n * H * V
        rec = {"n": n, "flops": flops}

        def torch_fn():
            logits = F.linear(hidden, W[:V]).float()
            logits += bias[:V]
            logits /= temps[:, None]
            lse = torch.logsumexp(logits, dim=-1)
            lp = logits.gather(1, targets[:, None].long()).squeeze(1) - lse
            return lp, lse

        if not args.no_torch:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t_lp, t_lse = torch_fn()
            torch.cuda.synchronize()
            rec["torch_extra_bytes"] = torch.cuda.max_memory_allocated() - base
            rec["torch_ms"], _, _ = median_ms(torch_fn, args.reps)
            rec["torch_matmul_ms"], _, _ = median_ms(lambda: F.linear(hidden, W[:V]), args.reps)

        stream = torch.cuda.current_stream().cuda_stream
        runs = {}
        for name, h in handles.items():
            ws_bytes = lib.logp_workspace_bytes(h, n)
            ws = torch.empty(max(ws_bytes, 1), device=dev, dtype=torch.uint8)
            lp = torch.full((n,), float("nan"), device=dev)
            lse = torch.full((n,), float("nan"), device=dev)

            def ours(h=h, ws=ws, lp=lp, lse=lse):
                rc = lib.logp_launch(
                    h,
                    hidden.data_ptr(),
                    targets.data_ptr(),
                    temps.data_ptr(),
                    lp.data_ptr(),
                    lse.data_ptr(),
                    n,
                    ws.data_ptr(),
                    stream,
                )
                if rc != 0:
                    raise RuntimeError("logp_launch failed")

            ours()
            torch.cuda.synchronize()
            assert torch.isfinite(lp).all() and torch.isfinite(lse).all()
            runs[name] = (ours, lp, lse, ws_bytes)
            rec[f"{name}_splits"] = lib.logp_num_splits(h, n)
            rec[f"{name}_extra_bytes"] = ws_bytes
            # Accuracy vs float64 on a few rows.
            sel = sorted(set([0, n // 2, n - 1]))
            hd = hidden[sel].double()
            z = (hd @ W[:V].double().T + bias[:V].double()) / temps[sel].double()[:, None]
            rl = torch.logsumexp(z, dim=-1)
            rp = z.gather(1, targets[sel].long()[:, None]).squeeze(1) - rl
            rec[f"{name}_err"] = max(
                (lp[sel].double() - rp).abs().max().item(),
                (lse[sel].double() - rl).abs().max().item(),
            )
            if name == "invariant" and not args.no_torch:
                rec["diff_vs_torch"] = (lp - t_lp).abs().max().item()
        names = list(runs)
        timed = median_ms_interleaved([runs[k][0] for k in names], args.reps)
        for k, (ms, lo, hi) in zip(names, timed):
            rec[f"{k}_ms"] = ms
            rec[f"{k}_spread"] = (lo, hi)
        del runs
        rec["gpu_state"] = gpu_state()
        rows_out.append(rec)
        msg = f"N={n}: ours {rec['invariant_ms']:.4f} ms [{rec['gpu_state']}]"
        if "torch_ms" in rec:
            msg += f", torch {rec['torch_ms']:.4f} ms"
        print(msg, flush=True)
        del hidden

    for h in handles.values():
        lib.logp_destroy(h)

    result = {
        "version": version,
        "device": props.name,
        "H": H,
        "V": V,
        "Vpad": Vp,
        "copy_ms": copy_ms,
        "floor_ms": floor_ms,
        "copy_tbps": bw,
        "cublas_tflops": peak_tflops,
        "rows": rows_out,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    print()
    print(
        f"kernel {version} | floor (weight read) {floor_ms:.4f} ms | "
        f"cuBLAS peak {peak_tflops:.0f} TFLOP/s | copy {bw:.2f} TB/s"
    )
    hdr = (
        f"{'N':>5} {'ours ms':>9} {'TFLOP/s':>8} {'%peak':>6} {'torch ms':>9}"
        f" {'torch TF':>8} {'x torch':>7} {'x floor':>7} {'thr ms':>9}"
        f" {'inv/thr':>7} {'splits':>7} {'err':>8} {'ws MB':>7} {'torch MB':>8}"
        f" {'mm ms':>8} {'spread ours':>17}"
    )
    print(hdr)
    for r in rows_out:
        n, f = r["n"], r["flops"]
        ms = r["invariant_ms"]
        tf = f / (ms * 1e-3) / 1e12
        tms = r.get("torch_ms", float("nan"))
        ttf = f / (tms * 1e-3) / 1e12
        print(
            f"{n:>5} {ms:>9.4f} {tf:>8.1f} {100 * tf / peak_tflops:>5.1f}%"
            f" {tms:>9.4f} {ttf:>8.1f} {tms / ms:>7.2f} {ms / floor_ms:>7.3f}"
            f" {r['throughput_ms']:>9.4f} {ms / r['throughput_ms']:>7.3f}"
            f" {r['invariant_splits']:>3}/{r['throughput_splits']:<3}"
            f" {max(r['invariant_err'], r['throughput_err']):>8.1e}"
            f" {r['invariant_extra_bytes'] / 1e6:>7.2f}"
            f" {r.get('torch_extra_bytes', 0) / 1e6:>8.1f}"
            f" {r.get('torch_matmul_ms', float('nan')):>8.4f}"
            f" {r['invariant_spread'][0]:>8.4f}-{r['invariant_spread'][1]:<8.4f}"
        )


if __name__ == "__main__":
    main()
