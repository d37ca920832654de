"""Many rollout workers at once: W worker processes, each with its own
detlogp.Client and a CUDA bf16 batch of N rows, call logprobs() at the same
moment, R rounds, against one server on one GPU (with --shared_memory
system the rows are moved to the host first: workers that do no GPU work
during the burst). Reports the aggregate
rows/s against detlogp.torch.linear_logp's on the same work (W x R batches
of N rows back to back, just before the burst; its median single call is
reported beside it), and how many calls failed (the target: none).

    python3 tools/device/fleet_burst_bench.py --server bin/detlogp_server \
        [--workers 8,32] [--rows 16384,4096] [--rounds 3] \
        [--shared_memory cuda,system,off] \
        [--server_flags "--batch_threads=1|--batch_threads=2"] [--json_out out.json]

--workers and --rows pair up (8 workers x 16384 rows, 32 x 4096). The
server runs with its default flags unless --server_flags adds some; sets
of flags separated by "|" each get a server of their own, one after the
other, over the same weights. The point is a burst larger than the queue. Each worker makes one
call of its full size before the burst (a rollout worker's steady state:
connections open, regions registered). Per burst it also reports each
call's median and slowest seconds, and from the server's metrics the rows it
refused for a full queue and the mean queue delay of its batches. Needs torch with CUDA, the detlogp
package (client/python on PYTHONPATH) and the CUDA ops library for
detlogp.torch ($DETLOGP_OPS_CUDA_LIBRARY).
"""

import argparse
import json
import multiprocessing
import os
import pathlib
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def _worker(target, shared_memory, rows, hidden, vocab, rounds, seed, ready, go, results):
    """One worker: its rows made on the GPU, then `rounds` calls once `go`
    is set; puts (seed, seconds of each call, failures, paths, when the last
    call was answered) on `results`."""
    import detlogp
    import torch

    torch.cuda.set_device(0)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    batches = [
        (
            torch.randn(rows, hidden, device="cuda", generator=generator).to(torch.bfloat16),
            torch.randint(0, vocab, (rows,), device="cuda", generator=generator).cpu().numpy(),
        )
        for _ in range(rounds)
    ]
    if shared_memory == "system":
        # Rows already on the host: the worker does no GPU work in the burst.
        batches = [(values.cpu(), targets) for values, targets in batches]
    torch.cuda.synchronize()
    failures, seconds, paths = [], [], set()
    with detlogp.Client(target, timeout=600, shared_memory=shared_memory) as client:
        client.logprobs(batches[0][0], batches[0][1])  # steady state
        ready.put(seed)
        go.wait()
        for values, targets in batches:
            began = time.perf_counter()
            try:
                result = client.logprobs(values, targets)
                paths.add(getattr(result, "path", "") or "")
            except detlogp.DetlogpError as error:
                failures.append(f"{type(error).__name__}: {error}"[:300])
            seconds.append(time.perf_counter() - began)
        finished = time.monotonic()  # the clock every process shares
    results.put((seed, seconds, failures, sorted(paths), finished))


def kernel_rows_per_s(weight, rows, vocab, calls, repeats=7):
    """detlogp.torch.linear_logp's rows/s on `rows`-row batches: over
    `calls` batches back to back, as much work as the burst (the GPU's
    clocks under a second of load, not its first milliseconds), and the
    median of `repeats` single calls. Fresh random rows for every call."""
    import detlogp.torch as detlogp_torch
    import torch

    def batch(seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        values = torch.randn(rows, weight.shape[1], device="cuda", generator=generator)
        targets = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
        return values.to(torch.bfloat16), targets

    times = []
    for run in range(repeats + 1):
        values, targets = batch(100 + run)
        torch.cuda.synchronize()
        began = time.perf_counter()
        detlogp_torch.linear_logp(values, weight, targets)
        torch.cuda.synchronize()
        if run:
            times.append(time.perf_counter() - began)
    batches = [batch(1000 + call) for call in range(calls)]
    torch.cuda.synchronize()
    began = time.perf_counter()
    for values, targets in batches:
        detlogp_torch.linear_logp(values, weight, targets)
    torch.cuda.synchronize()
    sustained = rows * calls / (time.perf_counter() - began)
    del batches
    torch.cuda.empty_cache()
    return sustained, rows / statistics.median(times)


def burst(args, target, mode, workers, rows, hidden, vocab, on_ready):
    """The burst's aggregate rows/s, failures, paths and call seconds;
    `on_ready()` runs once every worker is warmed up, just before the go
    (the server's counts then leave the warm-up calls out)."""
    context = multiprocessing.get_context("spawn")
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    processes = [
        context.Process(
            target=_worker,
            args=(target, mode, rows, hidden, vocab, args.rounds, seed, ready, go, results),
        )
        for seed in range(workers)
    ]
    for process in processes:
        process.start()
    for _ in processes:
        ready.get(timeout=600)
    on_ready()
    began = time.monotonic()
    go.set()
    answers = [results.get(timeout=1200) for _ in processes]
    # From the go to the last call's answer (closing clients not counted).
    wall = max(finished for *_, finished in answers) - began
    for process in processes:
        process.join(timeout=60)
    failures = [f for _, _, fs, _, _ in answers for f in fs]
    paths = sorted({p for _, _, _, ps, _ in answers for p in ps})
    seconds = sorted(s for _, ss, _, _, _ in answers for s in ss)
    return workers * rows * args.rounds / wall, failures, paths, seconds


def _server_counts(server):
    """(rows refused for a full queue, batches, seconds of queue delay, rows
    batched, seconds of compute summed over batches)."""
    samples = server.metrics() or {}
    return (
        samples.get('detlogp_rows_total{outcome="rejected"}', 0.0),
        samples.get("detlogp_queue_delay_seconds_count", 0.0),
        samples.get("detlogp_queue_delay_seconds_sum", 0.0),
        samples.get("detlogp_batch_rows_sum", 0.0),
        samples.get("detlogp_compute_seconds_sum", 0.0),
    )


def measure(args, server, socket, server_flags, mode, workers, rows, weight):
    """One burst against `server`, as a JSON-ready line (printed too), with
    the kernel's rate on the same work measured just before it."""
    kernel, kernel_single = kernel_rows_per_s(weight, rows, args.vocab, workers * args.rounds)
    before = []
    rate, failures, paths, seconds = burst(
        args,
        f"unix:{socket}",
        mode,
        workers,
        rows,
        args.hidden,
        args.vocab,
        on_ready=lambda: before.extend(_server_counts(server)),
    )
    after = _server_counts(server)
    refused, batches, queued, batched, computing = (a - b for a, b in zip(after, before))
    wall = workers * rows * args.rounds / rate
    line = dict(
        workers=workers,
        rows=rows,
        shared_memory=mode,
        kernel_rows_per_s=round(kernel),
        aggregate_rows_per_s=round(rate),
        ratio=round(rate / kernel, 3),
        # The kernel's median single call (boost clocks, no sustained load).
        kernel_single_call_rows_per_s=round(kernel_single),
        ratio_to_single_call=round(rate / kernel_single, 3),
        calls=workers * args.rounds,
        failed=len(failures),
        paths=paths,
        call_s_median=round(statistics.median(seconds), 4),
        call_s_max=round(seconds[-1], 4),
        rows_refused=int(refused),
        mean_queue_delay_ms=round(1e3 * queued / max(batches, 1), 2),
        # Where the server's time went: rows a batch, and the batches'
        # compute seconds summed (over 1.0 of the wall when batch threads
        # overlap on the device).
        mean_batch_rows=round(batched / max(batches, 1)),
        compute_s_per_batch=round(computing / max(batches, 1), 5),
        compute_over_wall=round(computing / wall, 3),
        server_flags=server_flags,
        first_failures=failures[:2],
    )
    print(json.dumps(line), flush=True)
    return line


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--workers", default="8,32")
    parser.add_argument("--rows", default="16384,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shared_memory", default="cuda,off")
    parser.add_argument(
        "--server_flags",
        default="",
        help='extra server flags, space separated; "|" separates sets, a server each',
    )
    parser.add_argument("--json_out")
    args = parser.parse_args()

    import torch
    from detlogp.testing import LocalServer
    from rollout_worker_bench import random_weight, write_weights

    folder = tempfile.mkdtemp(prefix="fleet-bench-")
    weight = random_weight(args.vocab, args.hidden, seed=1)
    path = write_weights(weight, folder)
    socket = os.path.join(folder, "detlogp.sock")
    lines = []
    for server_flags in args.server_flags.split("|"):
        flags = [
            f"--weights={path}",
            "--lm_head_tensor=lm_head.weight",
            "--device=cuda:0",
            f"--unix_socket={socket}",
            "--allow_shared_memory=true",
            *server_flags.split(),
        ]
        with LocalServer(args.server, flags, metrics=True, start_timeout=600) as server:
            for workers, rows in zip(
                (int(w) for w in args.workers.split(",")), (int(r) for r in args.rows.split(","))
            ):
                for mode in args.shared_memory.split(","):
                    lines.append(
                        measure(args, server, socket, server_flags, mode, workers, rows, weight)
                    )
    torch.cuda.synchronize()
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(lines, indent=1))
    return 1 if any(line["failed"] for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
