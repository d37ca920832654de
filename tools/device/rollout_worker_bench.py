"""One rollout worker's large batch: the service against the kernel it wraps,
measured in one process on one GPU.

    python3 tools/device/rollout_worker_bench.py --server .device/serve/detlogp_server \
        [--weights lm_head.safetensors] [--sizes 4096,16384,262144,1048576] \
        [--repeats 5] [--json_out /tmp/out/rollout_worker.json]

Needs torch with CUDA, the detlogp package (client/python on PYTHONPATH) and
the CUDA ops library for detlogp.torch ($DETLOGP_OPS_CUDA_LIBRARY, as
tools/device/run_twin.sh sets it). Without --weights, a random bf16 lm_head
[V, H] (H=4096, V=151936 by default) is written to a temporary .safetensors
file; the server serves that file and the kernel uses the same weight.

For each N it measures (median of --repeats runs, each on fresh random rows,
never zeros; rows/s = N / seconds of one call):
  kernel       detlogp.torch.linear_logp on the GPU (synchronized)
  cuda_shm     client.logprobs(CUDA bf16 tensor) over the Unix socket, the
               rows in a CUDA region the client owns
  system_shm   client.logprobs(CPU bf16 tensor) over the Unix socket, the
               rows in a system region the client owns
  tcp          client.logprobs(CPU bf16 tensor) to 127.0.0.1, no shared memory
  unix         client.logprobs(CPU bf16 tensor) over the Unix socket, no
               shared memory
and prints each path's rows/s and its ratio to the kernel's. Then the bits:
at N = --bits_rows every path gives the same bits, equal to the same rows in
4,096-row calls and to the kernel's (the trainer's twin). Exits non-zero
when a bits check fails.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))

import detlogp  # noqa: E402
import detlogp.torch as detlogp_torch  # noqa: E402
from detlogp import safetensors_io  # noqa: E402
from detlogp.testing import LocalServer  # noqa: E402

PATHS = ("cuda_shm", "system_shm", "tcp", "unix")


def random_weight(vocab, hidden, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.randn(vocab, hidden, device="cuda", generator=generator) * 0.02
    return weight.to(torch.bfloat16)


def write_weights(weight, folder):
    """The weight as lm_head.weight (bf16 bits) in a .safetensors file."""
    path = pathlib.Path(folder) / "lm_head.safetensors"
    bits = weight.view(torch.int16).cpu().numpy().view(np.uint16)
    safetensors_io.write(path, {"lm_head.weight": bits})
    return path


def fresh_rows(rows, hidden, vocab, seed):
    """bf16 rows on the GPU (~N(0, 1), never all zeros) and int64 targets."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    values = torch.randn(rows, hidden, device="cuda", generator=generator).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    return values, targets


def seconds_of(fn, synchronize=False):
    start = time.perf_counter()
    result = fn()
    if synchronize:
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the detlogp_server binary")
    parser.add_argument("--weights", help="a .safetensors lm_head (lm_head.weight, bf16)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--sizes", default="4096,16384,262144,1048576")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large_repeats", type=int, default=3, help="for N >= 262144")
    parser.add_argument("--bits_rows", type=int, default=262144)
    parser.add_argument("--server_flags", default="", help="more server flags, space-separated")
    parser.add_argument(
        "--connections", type=int, default=0, help="TransferOptions.connections (0: auto)"
    )
    parser.add_argument(
        "--slice_mb", type=int, default=8, help="TransferOptions.slice_bytes, MiB (gRPC bytes)"
    )
    parser.add_argument(
        "--region_piece_mb",
        type=int,
        default=8,
        help="TransferOptions.region_piece_bytes, MiB (system_shm pieces)",
    )
    parser.add_argument(
        "--native_transport",
        default="auto",
        choices=["auto", "on", "off"],
        help="TransferOptions.native_transport (large gRPC calls sent by the C++ client)",
    )
    parser.add_argument(
        "--keep_freed_memory",
        action="store_true",
        help="detlogp.keep_freed_memory() in this process first",
    )
    parser.add_argument("--json_out")
    args = parser.parse_args()
    if args.keep_freed_memory and not detlogp.keep_freed_memory():
        parser.error("--keep_freed_memory: this process's malloc is not glibc's")
    if args.bits_rows < 1:
        parser.error(f"--bits_rows: at least 1 row, got {args.bits_rows}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown:
        parser.error(f"--paths: unknown {sorted(unknown)} (known: {', '.join(PATHS)})")

    folder = tempfile.mkdtemp(prefix="rollout-bench-")
    if args.weights:
        bits = np.asarray(safetensors_io.read(args.weights)["lm_head.weight"]).view(np.int16)
        weight = torch.from_numpy(bits).cuda().view(torch.bfloat16)
        weights_path = args.weights
    else:
        weight = random_weight(args.vocab, args.hidden, seed=1)
        weights_path = write_weights(weight, folder)
    vocab, hidden = weight.shape
    socket = os.path.join(folder, "detlogp.sock")
    flags = [
        f"--weights={weights_path}",
        "--lm_head_tensor=lm_head.weight",
        "--device=cuda:0",
        f"--unix_socket={socket}",
        "--max_queue_rows=4194304",
        *args.server_flags.split(),
    ]
    print(f"H={hidden} V={vocab} sizes={sizes} paths={paths} repeats={args.repeats}", flush=True)
    lines = []

    def record(**fields):
        lines.append(fields)
        print(json.dumps(fields), flush=True)

    with LocalServer(args.server, flags, start_timeout=600) as server:
        targets_of = {
            "cuda_shm": f"unix:{socket}",
            "system_shm": f"unix:{socket}",
            "tcp": server.target,
            "unix": f"unix:{socket}",
        }
        modes = {"cuda_shm": "cuda", "system_shm": "system", "tcp": "off", "unix": "off"}
        options = detlogp.TransferOptions(
            connections=args.connections,
            slice_bytes=args.slice_mb << 20,
            region_piece_bytes=args.region_piece_mb << 20,
            native_transport=args.native_transport,
        )
        clients = {
            path: detlogp.Client(
                targets_of[path],
                timeout=600,
                transfer_options=options,
                shared_memory=modes[path],
            )
            for path in paths
        }
        summary = {}
        for rows in sizes:
            repeats = args.large_repeats if rows >= 262144 else args.repeats
            kernel = []
            for run in range(repeats + 1):  # the first run warms up
                values, targets = fresh_rows(rows, hidden, vocab, seed=1000 * rows + run)
                torch.cuda.synchronize()
                took, _ = seconds_of(
                    lambda: detlogp_torch.linear_logp(values, weight, targets), synchronize=True
                )
                if run:
                    kernel.append(took)
            del values
            summary[(rows, "kernel")] = rows / statistics.median(kernel)
            record(rows=rows, path="kernel", rows_per_s=summary[(rows, "kernel")], seconds=kernel)
            for path in paths:
                times, timings = [], None
                for run in range(repeats + 1):
                    values, targets = fresh_rows(rows, hidden, vocab, seed=2000 * rows + run)
                    ids = targets.cpu().numpy()
                    if path != "cuda_shm":
                        values = values.cpu()
                    torch.cuda.synchronize()
                    took, result = seconds_of(
                        lambda: clients[path].logprobs(values, ids, timing=True)
                    )
                    if run:
                        times.append(took)
                        timings = result.timings
                    del values
                summary[(rows, path)] = rows / statistics.median(times)
                record(
                    rows=rows,
                    path=path,
                    rows_per_s=summary[(rows, path)],
                    ratio_to_kernel=summary[(rows, path)] / summary[(rows, "kernel")],
                    seconds=times,
                    last_timings=timings.as_dict(),
                )

        print("\nrows/s (ratio to the kernel in the same run)")
        print(f"{'N':>9} {'kernel':>10} " + " ".join(f"{p:>20}" for p in paths))
        for rows in sizes:
            base = summary[(rows, "kernel")]
            cells = [
                f"{summary[(rows, p)]:>10.0f} ({summary[(rows, p)] / base:5.3f})" for p in paths
            ]
            print(f"{rows:>9} {base:>10.0f} " + " ".join(f"{c:>20}" for c in cells))

        # Bits: every path, the 4,096-row calls and the kernel agree.
        failures = []
        values, targets = fresh_rows(args.bits_rows, hidden, vocab, seed=7)
        ids = targets.cpu().numpy()
        host = values.cpu()
        twin = detlogp_torch.linear_logp(values, weight, targets).cpu().numpy()
        answers = {
            path: clients[path].logprobs(values if path == "cuda_shm" else host, ids).logprobs
            for path in paths
        }
        first = paths[0]
        small = np.concatenate(
            [
                clients[first]
                .logprobs(
                    (values if first == "cuda_shm" else host)[start : start + 4096],
                    ids[start : start + 4096],
                )
                .logprobs
                for start in range(0, args.bits_rows, 4096)
            ]
        )
        for path, got in answers.items():
            if got.tobytes() != small.tobytes():
                failures.append(
                    f"{path}: {int(np.sum(got.view(np.uint32) != small.view(np.uint32)))} rows differ from 4,096-row calls"
                )
        if twin.astype(np.float32).tobytes() != small.tobytes():
            failures.append("the kernel (detlogp.torch) differs from the service")
        for client in clients.values():
            client.close()
    record(bits_rows=args.bits_rows, bits_paths=paths, bits_failures=failures)
    print("bits: " + ("PASS" if not failures else "FAIL " + "; ".join(failures)))
    if args.json_out:
        pathlib.Path(args.json_out).write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
