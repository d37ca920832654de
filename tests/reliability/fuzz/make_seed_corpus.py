#!/usr/bin/env python3
"""Writes the seed corpus for request_validation_fuzzer: one selector byte
(0: limits H=8, vocab 100, 64 rows) then a serialized LogProbRequest, for
valid requests of every dtype and one of each malformed kind.

Usage: make_seed_corpus.py OUT_DIR
"""

import math
import pathlib
import sys

import numpy as np
from detlogp import tensors
from detlogp.v1 import detlogp_pb2 as pb

H, VOCAB = 8, 100


def request(rows=2, dtype="f32", **overrides):
    rng = np.random.default_rng(rows)
    values = rng.standard_normal((rows, H)).astype(np.float32)
    values.reshape(-1)[:4] = [np.inf, -0.0, 1e-40, np.nan][: values.size]
    array = {
        "f32": values,
        "f16": values.astype(np.float16),
        "bf16": tensors.float32_to_bf16_bits(values),
    }[dtype]
    fields = dict(
        hidden=tensors.to_tensor(array),
        target_ids=list(range(rows)),
        temperature=0.7,
        return_lse=True,
        request_id="seed",
    )
    fields.update(overrides)
    return pb.LogProbRequest(**fields)


def seeds():
    t = lambda shape, nbytes, dtype=pb.DTYPE_FLOAT32: pb.Tensor(
        dtype=dtype, shape=shape, data=b"\x01" * nbytes
    )
    yield "valid_f32", request()
    yield "valid_f16", request(dtype="f16")
    yield "valid_bf16", request(dtype="bf16")
    yield "valid_zero_rows", request(rows=0)
    yield "valid_64_rows", request(rows=64, target_ids=[i % VOCAB for i in range(64)])
    yield "empty", pb.LogProbRequest()
    yield "bad_dtype", request(hidden=t([2, H], 8 * H, dtype=9))
    yield "bad_rank", request(hidden=t([2 * H], 8 * H))
    yield "bad_h", request(hidden=t([2, H + 1], 8 * (H + 1)))
    yield "negative_n", request(hidden=t([-1, H], 0))
    yield "too_many_rows", request(rows=65, target_ids=[0] * 65)
    yield "short_data", request(hidden=t([2, H], 8 * H - 3))
    yield "target_count", request(target_ids=[1])
    yield "target_range", request(target_ids=[0, VOCAB])
    yield "target_negative", request(target_ids=[-5, 0])
    yield "temperature_nan", request(temperature=math.nan)
    yield "temperature_negative", request(temperature=-1.0)
    yield "huge_shape", request(hidden=t([2**40, 2**40], 0))


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, message in seeds():
        (out / name).write_bytes(b"\x00" + message.SerializeToString())
    print(f"{len(list(out.iterdir()))} seeds in {out}")


if __name__ == "__main__":
    main()
