"""5) Malformed input.
* libFuzzer over request validation (fuzz/request_validation_fuzzer.cc),
  built with clang -fsanitize=fuzzer,address by fuzz/build_fuzzer.sh, run
  from a seed corpus for a bounded time (DETLOGP_FUZZ_S, default 20 s).
* Random, truncated and bit-flipped bytes sent as gRPC messages to every
  method over the wire. Holds: the server never crashes, answers each call
  with a status, and afterwards still serves the same bits.
"""

import os
import pathlib
import random
import re
import subprocess
import sys
from collections import Counter

import detlogp
import grpc
from detlogp import requests
from detlogp.testing import LocalServer, raw_logprob_methods

FUZZ_DIR = pathlib.Path(__file__).resolve().parent / "fuzz"


def test_libfuzzer_over_request_validation(repo_root, tmp_path, report):
    seconds = int(os.environ.get("DETLOGP_FUZZ_S", "20"))
    build = subprocess.run(
        [str(FUZZ_DIR / "build_fuzzer.sh"), str(repo_root / "build" / "fuzz")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, f"fuzzer build failed:\n{build.stderr[-3000:]}"
    fuzzer = build.stdout.strip().splitlines()[-1]
    seeds, corpus = tmp_path / "seeds", tmp_path / "corpus"
    corpus.mkdir()
    subprocess.run(
        [sys.executable, str(FUZZ_DIR / "make_seed_corpus.py"), str(seeds)], check=True, timeout=60
    )
    run = subprocess.run(
        [
            fuzzer,
            f"-max_total_time={seconds}",
            # Peak RSS (what -rss_limit_mb reads) survives fork and exec:
            # after this process has held a large call, the fuzzer would
            # start "over" the limit. So bound each allocation instead.
            "-rss_limit_mb=0",
            "-malloc_limit_mb=2048",
            "-timeout=10",
            "-print_final_stats=1",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
            str(seeds),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )
    log = run.stderr
    runs = re.search(r"Done (\d+) runs in (\d+) second", log)
    cov = re.findall(r"cov: (\d+)", log)
    report(
        f"tried: libFuzzer for {seconds}s from {len(list(seeds.iterdir()))} seeds; "
        f"{runs.group(1) if runs else '?'} inputs, coverage {cov[-1] if cov else '?'} "
        f"edges, corpus grew to {len(list(corpus.iterdir()))}"
    )
    assert run.returncode == 0, f"fuzzer found a failure:\n{log[-4000:]}"
    report(
        "held: no crash, no sanitizer report, every error INVALID_ARGUMENT "
        "naming its field, every accepted request self-consistent"
    )


METHODS = [
    "/detlogp.v1.LogProbService/ComputeLogProbs",
    "/detlogp.v1.LogProbService/GetModelInfo",
    "/detlogp.v1.ProjectionService/Project",
]


def garbage_messages(valid, rng, count):
    """Random bytes, every truncation of a valid request, bit flips."""
    out = [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 2048))) for _ in range(count)]
    out += [valid[:cut] for cut in range(0, len(valid), max(1, len(valid) // 150))]
    for _ in range(count):
        flipped = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        out.append(bytes(flipped))
    return out


def test_random_and_truncated_bytes_over_the_wire(server_binary, model, report):
    identity = lambda b: b
    rng = random.Random(5)
    hidden, targets = model.random_rows(4, seed=5)
    valid = requests.logprob_request(hidden, targets, return_lse=True).SerializeToString()
    messages = garbage_messages(valid, rng, 150)
    with LocalServer(server_binary, model.flags + ["--cpu_threads=1"]) as server:
        with detlogp.Client(server.target) as client:
            before = client.logprobs(hidden, targets, return_lse=True)
        codes = Counter()
        with grpc.insecure_channel(server.target) as channel:
            unary = {
                m: channel.unary_unary(
                    m, request_serializer=identity, response_deserializer=identity
                )
                for m in METHODS
            }
            stream = raw_logprob_methods(channel)[1]
            unknown = channel.unary_unary(
                "/detlogp.v1.LogProbService/NoSuchMethod",
                request_serializer=identity,
                response_deserializer=identity,
            )
            for i, message in enumerate(messages):
                method = METHODS[i % len(METHODS)] if i % 5 else METHODS[0]
                try:
                    if method.endswith("Project"):
                        list(
                            channel.unary_stream(
                                method, request_serializer=identity, response_deserializer=identity
                            )(message, timeout=10)
                        )
                    else:
                        unary[method](message, timeout=10)
                    codes[(method.rsplit("/", 1)[1], "OK")] += 1
                except grpc.RpcError as error:
                    codes[(method.rsplit("/", 1)[1], error.code().name)] += 1
            for s in range(60):  # streams of garbage, valid messages mixed in
                batch = [rng.choice(messages) for _ in range(rng.randint(1, 5))]
                if s % 3 == 0:
                    batch.insert(0, valid)
                try:
                    answers = list(stream(iter(batch), timeout=10))
                    codes[("StreamLogProbs", f"OK({len(answers)})")] += 1
                except grpc.RpcError as error:
                    codes[("StreamLogProbs", error.code().name)] += 1
            for _ in range(5):
                try:
                    unknown(b"\x00", timeout=5)
                except grpc.RpcError as error:
                    codes[("NoSuchMethod", error.code().name)] += 1
        assert server.running(), f"server died:\n{server.log()[-2000:]}"
        with detlogp.Client(server.target) as client:
            after = client.logprobs(hidden, targets, return_lse=True)
            health = client.health()
        assert server.terminate() == 0
    total = sum(codes.values())
    report(
        f"tried: {len(messages)} random/truncated/bit-flipped messages over "
        f"{len(METHODS)} methods, 60 garbage streams, 5 unknown-method calls ({total} calls)"
    )
    report(f"outcomes: {dict(sorted(codes.items()))}")
    report(
        f"held: server alive, health {health}, same bits before/after "
        f"{before.logprobs.tobytes() == after.logprobs.tobytes()}, exit 0"
    )
    allowed = {"OK", "INVALID_ARGUMENT", "INTERNAL", "UNIMPLEMENTED", "RESOURCE_EXHAUSTED"}
    odd = {k: v for k, v in codes.items() if k[1].split("(")[0] not in allowed}
    assert not odd, odd
    assert codes[("NoSuchMethod", "UNIMPLEMENTED")] == 5
    assert health == "SERVING"
    assert before.logprobs.tobytes() == after.logprobs.tobytes()
    assert before.lse.tobytes() == after.lse.tobytes()
