"""How fast plain grpcio moves one caller's rows, with no detlogp client code.

Sends one pre-built LogProbRequest (ROWS random bf16 rows of H) as bytes,
from THREADS threads, each on its own connection, for SECONDS, and prints
one JSON line per thread count: calls, rows/s and hidden GB/s. Separates
what grpcio and the server's receive path cost from what the client adds.

  python3 grpc_floor_bench.py --target 127.0.0.1:PORT --rows 1024 \
      --threads 1,4,8 [--tuned]
"""

import argparse
import json
import threading
import time

import grpc
import numpy as np
from detlogp import wire

_METHOD = "/detlogp.v1.LogProbService/ComputeLogProbs"
_BF16 = 3  # detlogp.v1.DType.BF16

# The transport settings the detlogp client and server apply (see
# docs/performance.md, "One caller's large batch").
TUNED_OPTIONS = [
    ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
    ("grpc.http2.lookahead_bytes", 64 * 1024 * 1024),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.experimental.tcp_read_chunk_size", 4 * 1024 * 1024),
    ("grpc.experimental.tcp_min_read_chunk_size", 1024 * 1024),
]


def build_payload(rows, hidden, vocab, seed):
    rng = np.random.default_rng(seed)
    bits = rng.standard_normal((rows, hidden), dtype=np.float32).view(np.uint32)
    bf16 = (bits >> 16).astype(np.uint16)
    targets = rng.integers(0, vocab, rows, dtype=np.int64)
    return wire.encode_logprob_request(
        wire.RequestFields(), _BF16, (rows, hidden), targets, data=bf16
    )


def run(target, payload, rows, threads, seconds, options):
    stop = time.perf_counter() + seconds
    calls = [0] * threads
    errors = []

    def loop(i):
        channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", -1),
                *options,
            ],
        )
        call = channel.unary_unary(_METHOD)
        try:
            call(payload, timeout=60)  # connect and warm up
            while time.perf_counter() < stop:
                call(payload, timeout=60)
                calls[i] += 1
        except grpc.RpcError as error:
            errors.append(str(error))
        finally:
            channel.close()

    started = time.perf_counter()
    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    total = sum(calls)
    return {
        "rows_per_call": rows,
        "threads": threads,
        "calls": total,
        "rows_per_s": round(total * rows / elapsed),
        "hidden_gb_per_s": round(total * len(payload) / elapsed / 1e9, 3),
        "errors": errors[:2],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--threads", default="1,4,8")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--tuned", action="store_true", help="TUNED_OPTIONS on the channels")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    payload = build_payload(args.rows, args.hidden, args.vocab, args.seed)
    options = TUNED_OPTIONS if args.tuned else []
    for threads in (int(t) for t in args.threads.split(",")):
        result = run(args.target, payload, args.rows, threads, args.seconds, options)
        result["tuned"] = args.tuned
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
