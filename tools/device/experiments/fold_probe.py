"""Where a consumer warp's time goes in the Hopper split kernel, tile by tile.

Needs a bench library built with fold_probe.patch (README.md here):
clock64 stamps per (block, tile, consumer warp) for the K loop and the fold,
and in top-k folds the end of the prologue, the start of the busy path, the
end of the group loop, the TopKGroup calls and the survivors they met (the
counting itself costs a little), the cycles spent inside TopKGroup calls and,
of those, inside its TopKSite calls. Runs on the device machine:

  python3 tools/device/experiments/fold_probe.py LIB --ns 1024,4096

Prints, for logp-only and top-20: the K loop and fold cycles (mean, and the
slowest warp of each tile against the mean), then top-20's fold by wave and
by tile of the item. Items of a block are its persistent loop's iterations:
with row group 8, iteration i of every block is wave i. The probe keeps 256
tiles per block (N <= 6528 at H = 4096, V = 151936); later ones go unrecorded.
"""

import argparse
import ctypes
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from logp_extras_bench import load  # noqa: E402

BLOCKS, TILES, FIELDS = 132, 256, 12  # fold_probe.patch's g_probe layout
KLOOP, FOLD, PROLOGUE, LOOP_END, CALLS, BUSY, SURVIVORS, IN_GROUP, IN_SITE = (
    0,
    1,
    2,
    3,
    4,
    8,
    9,
    10,
    11,
)
TILES_PER_ITEM = 5  # V = 151936 at 132 splits


def run_probe(lib, handle, n, k, inputs, stream):
    hidden, targets, temps = inputs
    dev = hidden.device
    ws = torch.empty(
        max(lib.logp_workspace_bytes_extras(handle, n, 0, k), 1), device=dev, dtype=torch.uint8
    )
    lp, lse = torch.empty(n, device=dev), torch.empty(n, device=dev)
    top_ids = torch.empty((n, max(k, 1)), device=dev, dtype=torch.int32)
    top_lp = torch.empty((n, max(k, 1)), device=dev)
    launches = []
    for _ in range(3):  # the first launch warms up and is dropped
        lib.detlogp_probe_reset()
        if lib.logp_launch_extras(
            handle,
            hidden.data_ptr(),
            targets.data_ptr(),
            temps.data_ptr(),
            lp.data_ptr(),
            lse.data_ptr(),
            None,
            k,
            top_ids.data_ptr(),
            top_lp.data_ptr(),
            n,
            ws.data_ptr(),
            stream,
        ):
            sys.exit("launch failed")
        torch.cuda.synchronize()
        buf = np.zeros(BLOCKS * TILES * 8 * FIELDS, dtype=np.uint32)
        if lib.detlogp_probe_read(buf.ctypes.data, buf.nbytes) != 0:
            sys.exit("probe read failed")
        launches.append(buf.reshape(BLOCKS, TILES, 8, FIELDS))
    return np.stack(launches[1:]).astype(np.float64)  # [launch, block, tile, warp, field]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--ns", default="1024,4096")
    args = ap.parse_args()
    lib = load(args.lib)
    lib.detlogp_probe_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    H, V = 4096, 151936
    dev = torch.device("cuda")
    torch.manual_seed(8)
    W = (torch.randn(V, H, device=dev) * 0.02).to(torch.bfloat16)
    bias = torch.randn(V, device=dev) * 0.1
    handle = lib.logp_create(W.data_ptr(), bias.data_ptr(), H, V, V, 0, 0)
    stream = torch.cuda.current_stream().cuda_stream
    for n in [int(x) for x in args.ns.split(",")]:
        inputs = (
            torch.randn(n, H, device=dev).to(torch.bfloat16),
            torch.randint(0, V, (n,), device=dev, dtype=torch.int32),
            torch.rand(n, device=dev) * 1.5 + 0.5,
        )
        for k in (0, 20):
            a = run_probe(lib, handle, n, k, inputs, stream)
            used = a[..., FOLD].sum(axis=-1) > 0  # [launch, block, tile]
            kloop, fold = a[..., KLOOP][used], a[..., FOLD][used]  # [tiles, warps]
            slowest = fold.max(axis=1)
            print(
                f"N={n} top_k={k}: {len(fold)} block-tiles; K loop {kloop.mean():.0f} cycles; "
                f"fold mean {fold.mean():.0f}, slowest warp {slowest.mean():.0f} "
                f"(+{(slowest - fold.mean(axis=1)).mean():.0f})",
                flush=True,
            )
        tile = np.broadcast_to(np.arange(TILES)[None, None, :, None], a.shape[:4])
        used = a[..., FOLD] > 0
        print(
            f"N={n} top_k=20, per warp-tile: fold | maxima + prologue | busy path | "
            f"group loop | in TopKGroup | of which TopKSite | TopKGroup calls | survivors | "
            f"busy warps"
        )
        waves = (("wave 0", 0, 1), ("waves 1-3", 1, 4), ("waves 4-7", 4, 8))
        for name, first, last in waves:
            for t in range(TILES_PER_ITEM):
                sel = (
                    used
                    & (tile // TILES_PER_ITEM >= first)
                    & (tile // TILES_PER_ITEM < last)
                    & (tile % TILES_PER_ITEM == t)
                )
                if not sel.any():
                    continue
                x = a[sel]
                busy_start = x[:, BUSY]
                busy = np.where(busy_start > 0, x[:, PROLOGUE] - busy_start, 0)
                before = np.where(busy_start > 0, busy_start, x[:, PROLOGUE])
                print(
                    f"  {name} tile {t}: {x[:, FOLD].mean():7.0f} | {before.mean():6.0f} | "
                    f"{busy.mean():6.0f} | {(x[:, LOOP_END] - x[:, PROLOGUE]).mean():6.0f} | "
                    f"{x[:, IN_GROUP].mean():6.0f} | {x[:, IN_SITE].mean():6.0f} | "
                    f"{x[:, CALLS].mean():5.2f} | {x[:, SURVIVORS].mean():5.1f} | "
                    f"{100 * np.mean(busy > 300):3.0f} %",
                    flush=True,
                )


if __name__ == "__main__":
    main()
