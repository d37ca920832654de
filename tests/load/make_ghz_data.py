#!/usr/bin/env python3
"""Writes ghz payloads for detlogp as binary protobuf (for ghz -B):

  compute_N{rows}.bin   one LogProbRequest ([rows, H] bf16 + targets)
  compute_N{rows}_entropy_top{K}.bin  the same asking for entropy and top_k=K
  stream_N{rows}x{k}.bin  k LogProbRequests, each varint-length-prefixed
                          ("count-prefixed", what ghz reads for streams)
  stream_N{rows}x{k}_mixed.bin  the same, the requests cycling through
                          neither, entropy, top_k=K and both
  info.bin              an empty GetModelInfoRequest

  tests/load/make_ghz_data.py --out /tmp/ghz --hidden 1024 --vocab 32000
  tests/load/make_ghz_data.py --out /tmp/ghz --target 127.0.0.1:50051  # asks the server

Large tensors go as binary, never JSON: a 64 x 1024 bf16 request is 128 KiB.
"""

import argparse
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
try:
    import detlogp  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO_ROOT / "client" / "python"))

import detlogp  # noqa: E402
import numpy as np  # noqa: E402
from detlogp import requests, tensors  # noqa: E402
from detlogp.v1 import detlogp_pb2 as pb  # noqa: E402


def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def request(rows, hidden_size, vocab, rng, index, entropy=False, top_k=0):
    hidden = tensors.float32_to_bf16_bits(
        rng.standard_normal((rows, hidden_size)).astype(np.float32)
    )
    return requests.logprob_request(
        hidden,
        rng.integers(0, vocab, size=rows),
        return_lse=True,
        request_id=f"ghz-{index}",
        return_entropy=entropy,
        top_k=top_k,
    )


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True)
    p.add_argument("--target", help="read hidden/vocab size from this server")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--stream_messages", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--top_k",
        type=int,
        default=20,
        help="k of the entropy/top-k payloads (at most the server's --max_top_k)",
    )
    args = p.parse_args()
    if args.target:
        with detlogp.Client(args.target) as client:
            info = client.info()
        args.hidden, args.vocab = info.hidden_size, info.vocab_size
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    for rows in args.rows:
        (out / f"compute_N{rows}.bin").write_bytes(
            request(rows, args.hidden, args.vocab, rng, 0).SerializeToString()
        )
        blob = b""
        for i in range(args.stream_messages):
            message = request(rows, args.hidden, args.vocab, rng, i).SerializeToString()
            blob += varint(len(message)) + message
        (out / f"stream_N{rows}x{args.stream_messages}.bin").write_bytes(blob)
        (out / f"compute_N{rows}_entropy_top{args.top_k}.bin").write_bytes(
            request(rows, args.hidden, args.vocab, rng, 0, True, args.top_k).SerializeToString()
        )
        mixes = [(False, 0), (True, 0), (False, args.top_k), (True, args.top_k)]
        blob = b""
        for i in range(args.stream_messages):
            entropy, top_k = mixes[i % len(mixes)]
            message = request(
                rows, args.hidden, args.vocab, rng, i, entropy, top_k
            ).SerializeToString()
            blob += varint(len(message)) + message
        (out / f"stream_N{rows}x{args.stream_messages}_mixed.bin").write_bytes(blob)
    (out / "info.bin").write_bytes(pb.GetModelInfoRequest().SerializeToString())
    for path in sorted(out.glob("*.bin")):
        print(f"{path}  {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
