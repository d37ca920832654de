#!/usr/bin/env python3
"""The skew window of a two-phase push: the time from the first to the last
replica serving the new version, on N local servers under load.

N CPU servers (bazel-bin/server/detlogp_server) start with one head; callers
(one thread per server, each scoring 8 rows in a loop without a pin) keep
them busy while a detlogp.fleet.Pusher pushes P versions as deltas down a
chain, staged on every server and then committed on all of them. Per push it
reports:
  - reported: max - min of the servers' ModelVersionStatus.ready_unix_micros
    (the moment each made the version servable; one host, one clock);
  - observed: from the first to the last server whose caller got an answer
    on the new version (includes up to one call's latency per server);
  - commit: the pusher's commit phase (warm-up calls, then the commits).

Usage: tools/bench/skew_window.py [--servers 8] [--pushes 20] [--hidden 1024] [--vocab 8192]
"""

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client" / "python"))
import detlogp  # noqa: E402
from detlogp import safetensors_io, tensors  # noqa: E402
from detlogp.fleet import Pusher  # noqa: E402
from detlogp.testing import LocalServer, find_server_binary  # noqa: E402


def head(shape, seed):
    rng = np.random.default_rng(seed)
    return tensors.float32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * 0.02)


def step(bits, seed, fraction=0.04):
    rng = np.random.default_rng(seed)
    return bits ^ (rng.random(bits.shape) < fraction).astype(np.uint16)


class Caller(threading.Thread):
    """Scores without a pin on one server; records when each version was
    first answered."""

    def __init__(self, target, hidden, vocab, stop):
        super().__init__(daemon=True)
        self.client = detlogp.Client(target, timeout=30.0)
        rng = np.random.default_rng(7)
        self.rows = rng.standard_normal((8, hidden), dtype=np.float32)
        self.targets = rng.integers(0, vocab, 8)
        self.first_seen = {}  # version -> time.time() of the answer
        self.calls = 0
        self.errors = 0
        self.stop = stop

    def run(self):
        while not self.stop.is_set():
            try:
                result = self.client.logprobs(self.rows, self.targets)
            except detlogp.DetlogpError:
                self.errors += 1
                continue
            self.calls += 1
            self.first_seen.setdefault(result.model_version, time.time())


def ms(values):
    return f"median {statistics.median(values):7.2f} ms, max {max(values):7.2f} ms"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--fanout", default="chain", choices=("chain", "direct"))
    args = parser.parse_args()
    shape = (args.vocab, args.hidden)
    binary = find_server_binary(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        path = Path(folder) / "start.safetensors"
        weights = head(shape, 0)
        safetensors_io.write(path, {"lm_head.weight": weights})
        flags = [f"--weights={path}", "--device=cpu", "--cpu_threads=1"]
        servers = [stack.enter_context(LocalServer(binary, flags)) for _ in range(args.servers)]
        targets = [server.target for server in servers]
        stop = threading.Event()
        callers = [Caller(t, args.hidden, args.vocab, stop) for t in targets]
        for caller in callers:
            caller.start()
        reported, observed, commits = [], [], []
        with Pusher(targets, fanout=args.fanout) as pusher:
            pusher.upload_model("default", weights)  # the base of the deltas
            for index in range(args.pushes):
                weights = step(weights, 100 + index)
                start = time.perf_counter()
                result = pusher.upload_model("default", weights)
                total = time.perf_counter() - start
                ready = [s.ready_unix_micros for s in result.per_target.values()]
                reported.append((max(ready) - min(ready)) / 1e3)
                commits.append(pusher.last_commit_seconds * 1e3)
                deadline = time.time() + 10
                while time.time() < deadline and not all(
                    result.version in c.first_seen for c in callers
                ):
                    time.sleep(0.005)
                seen = [c.first_seen.get(result.version) for c in callers]
                if all(seen):
                    observed.append((max(seen) - min(seen)) * 1e3)
                print(
                    f"push {index + 1:2d}: version {result.version}, {total * 1e3:7.1f} ms, "
                    f"reported skew {reported[-1]:6.2f} ms, commit phase {commits[-1]:6.2f} ms"
                )
        stop.set()
        for caller in callers:
            caller.join()
        calls = sum(c.calls for c in callers)
        errors = sum(c.errors for c in callers)
        print(
            f"{args.servers} servers, head [{args.vocab}, {args.hidden}] bf16, "
            f"{args.pushes} pushes ({args.fanout}), {calls} calls during them, {errors} failed"
        )
        print(f"skew window, reported by the servers: {ms(reported)}")
        if observed:
            print(f"skew window, observed by callers:     {ms(observed)}")
        print(f"commit phase at the pusher:           {ms(commits)}")


if __name__ == "__main__":
    main()
