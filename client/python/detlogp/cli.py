"""The `detlogp` console command.

    detlogp info  --target HOST:PORT[,HOST:PORT...]
    detlogp score --target HOST:PORT --rows 4 --seed 1 [--lse] [--json]
    detlogp score --target HOST:PORT --hidden h.npy --targets t.npy
"""
import argparse
import json
import sys

import numpy as np

from detlogp.client import Client
from detlogp.errors import DetlogpError
from detlogp.v1 import detlogp_pb2 as pb


def _info(client, args):
    info = client.info()
    fields = {
        "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
        "padded_vocab_size": info.padded_vocab_size,
        "weight_dtype": pb.DType.Name(info.weight_dtype), "has_bias": info.has_bias,
        "weights_sha256": info.weights_sha256, "backend": info.backend,
        "kernel_version": info.kernel_version, "split_policy": info.split_policy,
        "determinism_key": info.determinism_key,
    }
    if args.json:
        print(json.dumps(fields))
    else:
        for key, value in fields.items():
            print(f"{key:18} {value}")


def _score(client, args):
    if args.hidden:
        hidden = np.load(args.hidden)
        if not args.targets:
            raise SystemExit("--hidden needs --targets")
        targets = np.load(args.targets)
    else:
        info = client.info()
        rng = np.random.default_rng(args.seed)
        hidden = rng.standard_normal((args.rows, info.hidden_size), dtype=np.float32)
        targets = rng.integers(0, info.vocab_size, size=args.rows)
    result = client.logprobs(hidden, targets, temperature=args.temperature,
                             return_lse=args.lse)
    rows = []
    for i, target in enumerate(np.asarray(targets).reshape(-1)):
        row = {"row": i, "target": int(target), "logprob": float(result.logprobs[i])}
        if result.lse is not None:
            row["lse"] = float(result.lse[i])
        rows.append(row)
    if args.json:
        print(json.dumps({"determinism_key": result.determinism_key, "rows": rows}))
    else:
        print(f"determinism_key {result.determinism_key}")
        for row in rows:
            extra = f"  lse {row['lse']:.9g}" if "lse" in row else ""
            print(f"row {row['row']:4d}  target {row['target']:8d}  "
                  f"logprob {row['logprob']:.9g}{extra}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="detlogp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051",
                        help="host:port, or several separated by commas")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="the model and its determinism key")
    score = sub.add_parser("score", help="log p(target) for rows")
    score.add_argument("--rows", type=int, default=4, help="random rows to score")
    score.add_argument("--seed", type=int, default=0)
    score.add_argument("--hidden", help=".npy [N, H] (float32/float16/uint16 bf16)")
    score.add_argument("--targets", help=".npy [N] int target ids")
    score.add_argument("--temperature", type=float, default=0.0)
    score.add_argument("--lse", action="store_true", help="also print logsumexp")
    args = parser.parse_args(argv)
    try:
        with Client(args.target, timeout=args.timeout) as client:
            {"info": _info, "score": _score}[args.command](client, args)
    except DetlogpError as error:
        print(f"detlogp: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
