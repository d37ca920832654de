#!/usr/bin/env python3
"""PyTorch baseline for the H3 video input projection, in the same run as our
kernels (tools/device/projection_bench_main.cu writes --ours JSON first).

PyTorch, TF32 off: forward F.linear(x, W, b); backward torch.autograd.grad of
that output for (x, W, b) (dX, dW, dbias), its extra peak memory; and dX alone
(dy @ W). Median of --reps CUDA-event timings after warm-up, fresh random
data per row count. Prints a markdown table last; --json writes everything.
"""

import argparse
import json

import torch
import torch.nn.functional as F
from timing import median_ms

K, N = 96, 5376


def torch_numbers(rows, reps):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = "cuda"
    w = (torch.rand(N, K, device=dev) * 2 - 1) * 0.1
    b = (torch.rand(N, device=dev) * 2 - 1) * 0.5
    x = torch.rand(rows, K, device=dev) * 2 - 1
    dy = torch.rand(rows, N, device=dev) * 2 - 1
    out = {}
    with torch.no_grad():
        out["fwd_ms"] = median_ms(lambda: F.linear(x, w, b), reps)[0]
        out["dx_ms"] = median_ms(lambda: dy @ w, reps)[0]
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    bg = b.clone().requires_grad_(True)
    y = F.linear(xg, wg, bg)
    out["bwd_ms"] = median_ms(
        lambda: torch.autograd.grad(y, (xg, wg, bg), dy, retain_graph=True), reps
    )[0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(y, (xg, wg, bg), dy, retain_graph=True)
    torch.cuda.synchronize()
    out["bwd_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    del grads, y, xg, wg, bg, x, dy
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--rows", default="1,128,1024,4096,13104,37296,72576,102816,108576,364608")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    ours = json.load(open(args.ours))
    rows_list = [int(r) for r in args.rows.split(",")]
    print(
        torch.__version__,
        torch.cuda.get_device_name(0),
        "allow_tf32:",
        torch.backends.cuda.matmul.allow_tf32,
    )
    fwd_ops = sorted({o["op"] for o in ours if o["op"].startswith("fwd:")})
    lines = [
        "| rows | "
        + " | ".join(f"{op} ms (TFLOP/s)" for op in fwd_ops)
        + " | torch fwd ms (TFLOP/s) | default/torch | our dX ms | torch dX ms"
        " | our dW+db ms | our bwd ms | torch bwd ms | bwd ours/torch"
        " | our bwd extra MB | torch bwd extra peak MB |",
        "|" + "---|" * (len(fwd_ops) + 11),
    ]
    results = []
    for rows in rows_list:
        t = torch_numbers(rows, args.reps)
        flops = 2.0 * rows * K * N
        mine = {o["op"]: o for o in ours if o["rows"] == rows}
        best = (
            mine["fwd:default"]["median_ms"]
            if "fwd:default" in mine
            else min((mine[op]["median_ms"] for op in fwd_ops if op in mine), default=float("nan"))
        )
        cells = [
            f"{mine[op]['median_ms']:.4f} ({mine[op]['tflops']:.1f})" if op in mine else "-"
            for op in fwd_ops
        ]
        dx = mine.get("dx", {}).get("median_ms", float("nan"))
        dw = mine.get("dw+db", {}).get("median_ms", float("nan"))
        bwd = mine.get("bwd(dx+dw+db)", {}).get("median_ms", float("nan"))
        supers = (rows - 1) // 4096 + 1
        ws = 0 if supers == 1 else supers * (N * K + N) * 4  # WeightGradWorkspaceBytes
        ws_dx = 42 * rows * K * 4 if 256 < rows <= 8192 else 0  # InputGradWorkspaceBytes
        ws = max(ws, ws_dx)  # one buffer serves dX, then dW
        our_mb = ((rows * K + N * K + N) * 4 + ws) / 2**20
        lines.append(
            f"| {rows} | "
            + " | ".join(cells)
            + f" | {t['fwd_ms']:.4f} ({flops / t['fwd_ms'] / 1e9:.1f}) |"
            f" {best / t['fwd_ms']:.2f} | {dx:.4f} | {t['dx_ms']:.4f} |"
            f" {dw:.4f} | {bwd:.4f} | {t['bwd_ms']:.4f} |"
            f" {bwd / t['bwd_ms']:.2f} | {our_mb:.1f} |"
            f" {t['bwd_peak_extra_bytes'] / 2**20:.1f} |"
        )
        results.append({"rows": rows, "torch": t, "ours": list(mine.values())})
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    if args.md:
        open(args.md, "w").write(table + "\n")


if __name__ == "__main__":
    main()
