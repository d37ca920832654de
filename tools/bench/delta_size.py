#!/usr/bin/env python3
"""Bytes a delta upload sends for one realistic training step.

fp32 master weights ~ N(0, 0.02), one Adam step (its first step moves every
weight by lr * sign(g)), both rounded to a bf16 head (round to nearest
even); then the payload of each encoding of the change, against the head's
bytes and the changed fraction:

  xor+zstd     UPLOAD_ENCODING_XOR_ZSTD, what the clients send
  sparse       index + value list: LEB128 gaps between changed elements,
               then their new 2-byte values (raw, and zstd-compressed)

With --push, also through real servers (bazel-bin/server/detlogp_server on
the CPU, two started with the old head): the new head pushed as a delta to
one and whole to the other, with the bytes each received
(detlogp_model_bytes_received_total{from="pusher"}), the time from the
call to the version being ready, and the digests, which must be equal.

Usage: tools/bench/delta_size.py [--hidden 4096] [--vocab 32768] [--lr 1e-6] [--push]
(needs numpy and zstandard; 4096 x 32768 is a 256 MiB head)
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client" / "python"))
from detlogp import delta, tensors  # noqa: E402


def leb128_gaps(indices):
    """LEB128 bytes of the gaps between ascending indices (first from -1)."""
    gaps = np.diff(indices, prepend=-1).astype(np.uint64) - 1
    out = []
    for shift in range(0, 64, 7):
        more = gaps >= (np.uint64(1) << np.uint64(shift + 7))
        out.append(
            ((gaps >> np.uint64(shift)) & np.uint64(0x7F)).astype(np.uint8)
            | (more * 0x80).astype(np.uint8)
        )
        if not more.any():
            break
    # Interleave per element: byte k of element i where present.
    lengths = np.ones(len(gaps), dtype=np.int64)
    for k in range(1, len(out)):
        lengths += (gaps >= (np.uint64(1) << np.uint64(7 * k))).astype(np.int64)
    total = int(lengths.sum())
    data = np.empty(total, dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for k, plane in enumerate(out):
        present = lengths > k
        data[starts[present] + k] = plane[present]
    return data.tobytes()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--push", action="store_true", help="also push through two local servers")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    shape = (args.vocab, args.hidden)
    master = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    old = tensors.float32_to_bf16_bits(master)
    sign = np.where(rng.random(shape, dtype=np.float32) < 0.5, np.float32(-1), np.float32(1))
    master -= np.float32(args.lr) * sign
    del sign
    new = tensors.float32_to_bf16_bits(master)
    del master
    head_bytes = new.nbytes
    changed = np.flatnonzero(old.reshape(-1) != new.reshape(-1))
    fraction = len(changed) / new.size
    print(
        f"head [{args.vocab}, {args.hidden}] bf16: {head_bytes} bytes; "
        f"lr {args.lr:g}: {len(changed)} elements changed ({100 * fraction:.2f}%)"
    )
    print(f"target: <= 1.5 x changed fraction x head = {int(1.5 * fraction * head_bytes)} bytes")

    for level in (1, 3):
        start = time.perf_counter()
        data = delta.encode_xor_delta(
            [new.reshape(-1).view(np.uint8)], [old.reshape(-1).view(np.uint8)], level=level
        )
        seconds = time.perf_counter() - start
        rebuilt = delta.decode_xor_delta(data, [old.reshape(-1).view(np.uint8)])
        assert rebuilt == new.tobytes(), "xor+zstd did not rebuild the head"
        print(
            f"xor+zstd level {level}: {len(data)} bytes = "
            f"{100 * len(data) / head_bytes:.2f}% of the head = "
            f"{len(data) / (fraction * head_bytes):.2f} x changed bytes "
            f"(encoded in {seconds:.2f} s)"
        )

    start = time.perf_counter()
    sparse = leb128_gaps(changed) + new.reshape(-1)[changed].tobytes()
    seconds = time.perf_counter() - start
    print(
        f"sparse gaps+values: {len(sparse)} bytes = "
        f"{100 * len(sparse) / head_bytes:.2f}% = "
        f"{len(sparse) / (fraction * head_bytes):.2f} x changed bytes "
        f"(encoded in {seconds:.2f} s)"
    )
    import zstandard

    packed = zstandard.ZstdCompressor(level=3).compress(sparse)
    print(
        f"sparse gaps+values, zstd: {len(packed)} bytes = "
        f"{100 * len(packed) / head_bytes:.2f}% = "
        f"{len(packed) / (fraction * head_bytes):.2f} x changed bytes"
    )
    if args.push:
        push_through_servers(old, new)


def push_through_servers(old, new):
    """The new head to one server as a delta and to another whole."""
    import tempfile

    from detlogp import safetensors_io
    from detlogp.fleet import Pusher
    from detlogp.testing import LocalServer, find_server_binary

    binary = find_server_binary(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "old.safetensors"
        safetensors_io.write(path, {"lm_head.weight": old})
        flags = [f"--weights={path}", "--device=cpu"]
        with (
            LocalServer(binary, flags, metrics=True) as by_delta,
            LocalServer(binary, flags, metrics=True) as by_head,
        ):
            results = {}
            for name, server, base_version in (("delta", by_delta, 1), ("head", by_head, 0)):
                with Pusher([server.target]) as pusher:
                    start = time.perf_counter()
                    results[name] = pusher.upload_model(
                        "default",
                        new,
                        version=2,
                        base_version=base_version,
                        base_weights=old if base_version else None,
                    )
                    seconds = time.perf_counter() - start
                received = server.metrics()['detlogp_model_bytes_received_total{from="pusher"}']
                print(
                    f"push as {name}: {int(received)} bytes received by the server, "
                    f"{seconds:.2f} s from the call to ready (encoding included)"
                )
                for line in server.log().splitlines():
                    if "upload of default" in line or "version 2 ready" in line:
                        print("  server:", line.split("] ", 2)[-1])
            assert results["delta"].weights_sha256 == results["head"].weights_sha256
            assert results["delta"].determinism_key == results["head"].determinism_key
            print(f"equal digests and keys: {results['delta'].weights_sha256}")


if __name__ == "__main__":
    main()
