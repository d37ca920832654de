#!/usr/bin/env python3
"""detlogp load tool: unary + streaming calls at a fixed concurrency or
request rate for a bounded time, every answer's bits checked against the same
row computed alone. Requests mix entropy, top-k (several k), both and
neither (--extras mix, the default): a row's entropy must keep its solo
bits and its top-k list must be the first k of its solo list, bit for bit,
whatever the request and batch around it asked for. Prints a short table
and writes JSON.

  # against a running server
  tests/load/detlogp_load.py --target 127.0.0.1:50051 --clients 64 --duration 20
  # start bazel-bin/server/detlogp_server (embedded synthetic model) itself
  tests/load/detlogp_load.py --spawn --clients 64 --duration 20 --json-out load.json
  # open loop: 40 calls/s (a stream is one call), at most 200 in flight
  tests/load/detlogp_load.py --spawn --rate 40 --clients 200 --duration 20
  # log p(target) and lse only (servers without entropy / top-k)
  tests/load/detlogp_load.py --spawn --extras none

Exit status: 0 when every answer arrived once with solo-identical bits and no
call failed; 1 otherwise. Needs the detlogp package (client/python) installed,
or importable from the source tree.
"""

import argparse
import asyncio
import json
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
try:
    import detlogp  # noqa: F401
except ImportError:  # run from the source tree without installing
    sys.path.insert(0, str(REPO_ROOT / "client" / "python"))

import detlogp  # noqa: E402
from detlogp.loadgen import NEITHER, LoadConfig, RowPool, extras_mix, run_load  # noqa: E402
from detlogp.testing import LocalServer, find_server_binary  # noqa: E402


def parse_range(text):
    low, _, high = text.partition(":")
    return (int(low), int(high or low))


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--target",
        action="append",
        default=[],
        help="host:port (repeat for round-robin over several)",
    )
    p.add_argument(
        "--spawn",
        action="store_true",
        help="start bazel-bin/server/detlogp_server on a free loopback port",
    )
    p.add_argument(
        "--server_arg",
        action="append",
        default=[],
        help="extra flag for the spawned server (repeatable)",
    )
    p.add_argument("--clients", type=int, default=64, help="concurrent callers")
    p.add_argument(
        "--channels", type=int, default=0, help="channels shared by the callers (0: one per caller)"
    )
    p.add_argument("--duration", type=float, default=10.0, help="seconds")
    p.add_argument("--max_requests", type=int, default=1_000_000)
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="calls started per second in all, open loop; a stream of 1-5 requests counts as one call (0: closed loop)",
    )
    p.add_argument("--stream_fraction", type=float, default=0.5)
    p.add_argument("--rows", type=parse_range, default=(1, 8), help="rows per request, MIN:MAX")
    p.add_argument(
        "--stream_requests", type=parse_range, default=(1, 5), help="requests per stream, MIN:MAX"
    )
    p.add_argument("--pool_rows", type=int, default=64, help="distinct rows scored alone first")
    p.add_argument("--timeout", type=float, default=30.0, help="per call, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--extras",
        choices=["mix", "none"],
        default="mix",
        help="mix: requests ask for entropy, top-k, both or neither "
        "in about equal shares; none: log p(target) and lse only",
    )
    p.add_argument(
        "--max_top_k",
        type=int,
        default=20,
        help="largest top_k asked for (at most the server's --max_top_k)",
    )
    p.add_argument("--json_out", help="write the JSON report here")
    args = p.parse_args(argv)

    server = None
    if args.spawn:
        binary = find_server_binary(REPO_ROOT)
        if binary is None:
            sys.exit("no bazel-bin/server/detlogp_server: bazel build //server:detlogp_server")
        server = LocalServer(binary, args.server_arg).start()
        args.target.append(server.target)
    if not args.target:
        sys.exit("give --target HOST:PORT or --spawn")
    try:
        with detlogp.Client(args.target) as client:
            info = client.info()
        pool = RowPool.random(info.hidden_size, info.vocab_size, args.pool_rows, args.seed)
        extras = extras_mix(args.max_top_k) if args.extras == "mix" else (NEITHER,)
        solo_top_k = max(k for _, k in extras)
        for target in args.target:  # every target must give the same solo bits
            pool.score_solo(target, entropy=args.extras == "mix", top_k=solo_top_k)
        config = LoadConfig(
            targets=args.target,
            clients=args.clients,
            duration_s=args.duration,
            max_requests=args.max_requests,
            rate=args.rate or None,
            stream_fraction=args.stream_fraction,
            rows=args.rows,
            stream_requests=args.stream_requests,
            timeout_s=args.timeout,
            channels=args.channels or None,
            seed=args.seed,
            extras=extras,
        )
        report = asyncio.run(run_load(config, pool))
    finally:
        if server is not None:
            server.terminate()
    summary = report.summary()
    summary["config"] = {k: v for k, v in vars(args).items() if k != "json_out"}
    summary["model"] = {
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "backend": info.backend,
        "determinism_key": info.determinism_key,
    }
    if server is not None:
        summary["server_stop"] = server.stop_counts()
    print(report.table())
    text = json.dumps(summary, indent=2, default=str)
    if args.json_out:
        pathlib.Path(args.json_out).write_text(text + "\n")
    else:
        print(text)
    clean = (
        report.rows_mismatched == 0
        and report.lost == 0
        and report.duplicated == 0
        and report.out_of_order == 0
        and not report.errors
        and report.key_mismatches == 0
        and report.answers == report.requests_sent
    )
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
