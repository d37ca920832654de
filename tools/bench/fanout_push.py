#!/usr/bin/env python3
"""One push to N local servers, direct and as a chain: the time from the
call to the last server's version being ready, and the upload bytes the
servers received from the pusher and from peers
(detlogp_model_bytes_received_total), and the CPU seconds (user + system,
from /proc/<pid>/stat) each server spent on the push.

N servers ($DETLOGP_SERVER, else bazel-bin/server/detlogp_server; on the
CPU unless --device=cuda:0, every server on that GPU) start with one head; a new
head of the same shape is pushed to all of them with detlogp.fleet.Pusher,
first directly (the pusher uploads to each), then as a chain (to the first,
which forwards to the next as the bytes arrive), then one server alone.

Usage: tools/bench/fanout_push.py [--servers 8] [--hidden 4096] [--vocab 32768]
    [--device cpu|cuda:0] [--pushes direct,chain,one] [--json_out out.json]
(4096 x 32768 is a 256 MiB head; 4096 x 151936 is 1.24 GB)
"""

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client" / "python"))
from detlogp import safetensors_io, tensors  # noqa: E402
from detlogp.fleet import Pusher  # noqa: E402
from detlogp.testing import LocalServer, find_server_binary  # noqa: E402

PUSHER = 'detlogp_model_bytes_received_total{from="pusher"}'
PEER = 'detlogp_model_bytes_received_total{from="peer"}'


def head(shape, seed):
    rng = np.random.default_rng(seed)
    return tensors.float32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * 0.02)


def received(servers):
    pusher = peer = 0
    for server in servers:
        samples = server.metrics()
        pusher += samples[PUSHER]
        peer += samples[PEER]
    return int(pusher), int(peer)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--pushes",
        default="direct,chain,one",
        help="which pushes to time, in order: direct (to every server), "
        "chain (down every server), one (to the first server alone)",
    )
    parser.add_argument("--json_out")
    args = parser.parse_args()
    shape = (args.vocab, args.hidden)
    binary = find_server_binary(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        path = Path(folder) / "start.safetensors"
        safetensors_io.write(path, {"lm_head.weight": head(shape, 0)})
        flags = [f"--weights={path}", f"--device={args.device}"]
        if args.device == "cpu":
            flags.append("--cpu_threads=1")
        servers = [
            stack.enter_context(LocalServer(binary, flags, metrics=True))
            for _ in range(args.servers)
        ]
        targets = [server.target for server in servers]
        head_bytes = int(np.prod(shape)) * 2
        print(
            f"{args.servers} servers, head [{args.vocab}, {args.hidden}] bf16 = {head_bytes} bytes"
        )
        weights = head(shape, 1)
        lines = []
        pushes = {
            "direct": ("direct", targets),
            "chain": ("chain", targets),
            "one": ("direct", targets[:1]),
        }
        for version, name in enumerate(args.pushes.split(","), start=2):
            fanout, to = pushes[name]
            before = received(servers)
            cpu_before = [server.cpu_seconds() for server in servers[: len(to)]]
            pusher_cpu_before = time.process_time()
            with Pusher(to, fanout=fanout) as pusher:
                start = time.perf_counter()
                result = pusher.upload_model("default", weights, version=version, base_version=0)
                seconds = time.perf_counter() - start
            pusher_cpu = time.process_time() - pusher_cpu_before
            cpu = [server.cpu_seconds() - b for server, b in zip(servers[: len(to)], cpu_before)]
            after = received(servers)
            assert result.version == version and len(result.per_target) == len(to)
            pusher_bytes, peer_bytes = (a - b for a, b in zip(after, before))
            print(
                f"{fanout:6s} to {len(to)}: last ready after {seconds:.2f} s; from the pusher "
                f"{pusher_bytes / head_bytes:.2f} x the head, from peers {peer_bytes / head_bytes:.2f} x; "
                f"server CPU {sum(cpu):.2f} s summed, per server in order "
                f"[{' '.join(f'{c:.2f}' for c in cpu)}] s, the pusher's {pusher_cpu:.2f} s"
            )
            lines.append(
                dict(
                    push=name,
                    fanout=fanout,
                    servers=len(to),
                    device=args.device,
                    head_bytes=head_bytes,
                    last_ready_s=round(seconds, 3),
                    from_pusher_over_head=round(pusher_bytes / head_bytes, 3),
                    from_peers_over_head=round(peer_bytes / head_bytes, 3),
                    server_cpu_s=[round(c, 3) for c in cpu],
                    server_cpu_total_s=round(sum(cpu), 3),
                    pusher_cpu_s=round(pusher_cpu, 3),
                )
            )
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(lines, indent=1))


if __name__ == "__main__":
    main()
