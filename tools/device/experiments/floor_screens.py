"""What a speculative floor in each row's screen word buys top-k (issue #11).

A measurement, never a product: needs a library built with floor_screens.patch
(-DDETLOGP_FLOOR_SCREENS=1, `logp_set_screen_template`), whose launcher copies
a [rows][68]-word template into the top-k screens instead of zeroing them.
Here the template's word holds, per row, S = mean + c * std of z over a
strided sample of `--sample` columns (PyTorch, outside the timed launches),
or ("oracle") the row's k-th best z less 1e-3. A floor above a row's k-th
best drops some of its top-k: such a row's list comes out short (id -1 at
entry k-1), which is counted; rows that did not fail must equal the cleared
screens' bits. The sample's own cost is timed as PyTorch's matmul and
moments, a stand-in for a kernel of our own.

  python3 tools/device/experiments/floor_screens.py \
      --lib .device/logp/liblogp_bench_floor.so --seed 8 --ns 1024,2048,4096
"""

import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from logp_bench import bench_arguments, median_ms_interleaved  # noqa: E402
from logp_extras_bench import load  # noqa: E402
from timing import median_ms  # noqa: E402

TOP_K = 20
SCREEN_WORDS = 68
SCREEN_WORD = 64


def screen_keys(z):
    """kernels/top_k_screen_key.h's ScreenKey, as int32 bit patterns."""
    b = z.float().contiguous().view(torch.int32)
    return torch.where(b < 0, ~b, b | torch.tensor(-(2**31), dtype=torch.int32, device=z.device))


def template_of(floor):
    t = torch.zeros(floor.numel(), SCREEN_WORDS, dtype=torch.int32, device=floor.device)
    t[:, SCREEN_WORD] = screen_keys(floor)
    return t


def main():
    ap = bench_arguments()
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--sample", type=int, default=256)
    ap.add_argument("--cs", default="2.6,2.8,3.0,3.2")
    args = ap.parse_args()

    lib = load(args.lib)
    lib.logp_set_screen_template.restype = None
    lib.logp_set_screen_template.argtypes = [ctypes.c_void_p]
    H, V, Vp = args.hidden, args.vocab, args.padded_vocab
    dev = torch.device("cuda")
    torch.manual_seed(args.seed)  # the extras bench's inputs, draw for draw
    W = (torch.randn(Vp, H, device=dev) * 0.02).to(torch.bfloat16)
    bias = torch.randn(Vp, device=dev) * 0.1
    handle = lib.logp_create(W.data_ptr(), bias.data_ptr(), H, V, Vp, 0, 0)
    stream = torch.cuda.current_stream().cuda_stream
    sample = torch.arange(args.sample, device=dev) * (V // args.sample)
    W_s, b_s = W[sample].contiguous(), bias[sample].contiguous()
    cs = [float(c) for c in args.cs.split(",")]
    print(
        f"kernel {lib.logp_version().decode()}; sample {args.sample} columns; c in {cs}", flush=True
    )

    for n in [int(x) for x in args.ns.split(",")]:
        hidden = torch.randn(n, H, device=dev).to(torch.bfloat16)
        targets = torch.randint(0, V, (n,), device=dev, dtype=torch.int32)
        temps = torch.rand(n, device=dev) * 1.5 + 0.5

        def floors(c):
            z = (torch.nn.functional.linear(hidden, W_s).float() + b_s) / temps[:, None]
            return z.mean(-1) + c * z.std(-1)

        def launcher(k, template):
            ws = torch.empty(
                lib.logp_workspace_bytes_extras(handle, n, 0, k), device=dev, dtype=torch.uint8
            )
            out = [torch.full((n,), float("nan"), device=dev) for _ in range(2)]
            ids = torch.full((n, max(k, 1)), -7, device=dev, dtype=torch.int32)
            lps = torch.full((n, max(k, 1)), float("nan"), device=dev)

            def run():
                lib.logp_set_screen_template(None if template is None else template.data_ptr())
                if lib.logp_launch_extras(
                    handle,
                    hidden.data_ptr(),
                    targets.data_ptr(),
                    temps.data_ptr(),
                    out[0].data_ptr(),
                    out[1].data_ptr(),
                    None,
                    k,
                    ids.data_ptr(),
                    lps.data_ptr(),
                    n,
                    ws.data_ptr(),
                    stream,
                ):
                    raise RuntimeError("launch failed")

            return run, (out[0], out[1], ids, lps)

        names, fns, outs = [], [], {}
        for name, k, template in [("logp", 0, None), ("top20", TOP_K, None)]:
            fn, o = launcher(k, template)
            fn()
            names.append(name), fns.append(fn)
            outs[name] = o
        torch.cuda.synchronize()
        ref = outs["top20"]
        kth_z = ref[3][:, TOP_K - 1] + ref[1]
        variants = [("oracle", kth_z - 1e-3)] + [(f"c{c}", floors(c)) for c in cs]
        for name, floor in variants:
            fn, o = launcher(TOP_K, template_of(floor))
            fn()
            torch.cuda.synchronize()
            short = o[2][:, TOP_K - 1] < 0
            ok = ~short
            same = all(
                torch.equal(
                    a[ok].view(torch.int32) if a.dtype == torch.float32 else a[ok],
                    b[ok].view(torch.int32) if b.dtype == torch.float32 else b[ok],
                )
                for a, b in zip(o, ref)
            )
            print(
                f"N={n} {name}: rows short {int(short.sum())} (floor above the k-th: "
                f"{int((floor > kth_z).sum())}); others' bits equal: {same}",
                flush=True,
            )
            names.append(name), fns.append(fn)
        timed = median_ms_interleaved(fns, args.reps)
        base = timed[0][0]
        sample_ms = median_ms(lambda: floors(cs[0]), args.reps)[0]
        line = "  ".join(
            f"{nm} {ms:.4f} ms ({100 * (ms / base - 1):+.1f}%)"
            for nm, (ms, _, _) in zip(names, timed)
        )
        print(
            f"N={n}: {line}; sample+moments (torch) {sample_ms:.4f} ms "
            f"({100 * sample_ms / base:.1f}% of logp)",
            flush=True,
        )
        lib.logp_set_screen_template(None)
        del hidden, fns, outs


if __name__ == "__main__":
    main()
