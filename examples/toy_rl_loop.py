#!/usr/bin/env python3
"""A toy RL loop on detlogp's live weights.

A trainer updates an lm_head every step (a REINFORCE-like step on random
rows, in numpy) and pushes it with upload_model, while rollout workers
(threads) keep scoring rows with the LATEST policy and the frozen reference.
Each worker records (rows, model_version, logprobs) as answered. At the end
every recorded answer is scored again, pinned to the version it named, and
must give identical bits; the script prints a summary and exits 1 on any
mismatch.

    pip install ./client/python
    bazel build //server:detlogp_server
    python examples/toy_rl_loop.py                     # starts a CPU server
    python examples/toy_rl_loop.py --device cuda:0     # ... on a GPU
    python examples/toy_rl_loop.py --target host:port --admin-token T

With --target, the server must keep every version the run makes
(--max_versions_per_model >= steps + 1); a server started here gets that.
"""

import argparse
import collections
import pathlib
import sys
import tempfile
import threading
import time

import detlogp
import detlogp._common
import numpy as np
from detlogp import safetensors_io
from detlogp.testing import LocalServer, find_server_binary

Record = collections.namedtuple("Record", "worker model hidden targets version key logprobs")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--target",
        help="a running server (host:port, or several "
        "comma-separated replicas); default: start one",
    )
    p.add_argument(
        "--server",
        help="server binary to start (default: $DETLOGP_SERVER or bazel-bin/server/detlogp_server)",
    )
    p.add_argument(
        "--device", default="cpu", help="--device of a server started here: cpu, cuda:0, ..."
    )
    p.add_argument("--token", help="scoring bearer token")
    p.add_argument("--admin-token", help="admin bearer token (uploads)")
    p.add_argument("--steps", type=int, default=8, help="policy updates")
    p.add_argument("--hidden", type=int, default=256, help="H (a multiple of 8)")
    p.add_argument("--vocab", type=int, default=4096, help="V")
    p.add_argument("--workers", type=int, default=4, help="rollout threads")
    p.add_argument("--rows", type=int, default=16, help="rows per rollout call, at most")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--step-interval", type=float, default=0.05, help="seconds the trainer waits between steps"
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Trainer:
    """lm_head W [V, H] and bias b in float32, changed by a policy-gradient
    step on random rows: W += lr * sum_i a_i (onehot(t_i) - softmax(W h_i)) h_i^T."""

    def __init__(self, hidden, vocab, lr, seed):
        self.rng = np.random.default_rng(seed)
        self.weight = (self.rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)).astype(
            np.float32
        )
        self.bias = np.zeros(vocab, np.float32)
        self.lr = lr

    def step(self, batch=32):
        hidden = self.rng.standard_normal((batch, self.weight.shape[1])).astype(np.float32)
        targets = self.rng.integers(0, self.weight.shape[0], size=batch)
        advantages = self.rng.standard_normal(batch).astype(np.float32)
        z = hidden @ self.weight.T + self.bias
        z -= z.max(axis=1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(axis=1, keepdims=True)
        grad_z = -probs
        grad_z[np.arange(batch), targets] += 1.0
        grad_z *= advantages[:, None]
        self.weight += self.lr * (grad_z.T @ hidden) / batch
        self.bias += self.lr * grad_z.mean(axis=0)


def rollout(worker, client, args, stop, records, errors):
    rng = np.random.default_rng(1000 + worker)
    try:
        while not stop.is_set():
            n = int(rng.integers(1, args.rows + 1))
            hidden = rng.standard_normal((n, args.hidden)).astype(np.float32)
            targets = rng.integers(0, args.vocab, size=n)
            for model in ("policy", "reference"):
                answer = client.logprobs(hidden, targets, model=model)
                records.append(
                    Record(
                        worker,
                        model,
                        hidden,
                        targets,
                        answer.model_version,
                        answer.determinism_key,
                        answer.logprobs,
                    )
                )
    except Exception as error:  # reported by the main thread
        errors.append(error)


def highest_version(args, target, model):
    """The highest version of `model` that any replica holds (0: none)."""
    highest = 0
    for one in detlogp._common.normalize_targets(target):
        with detlogp.Client(one, token=args.token, admin_token=args.admin_token) as client:
            for info in client.list_models().models:
                if info.model == model:
                    highest = max([highest] + [v.version for v in info.versions])
    return highest


def run(args, target, started_here):
    client = detlogp.Client(target, timeout=120.0, token=args.token, admin_token=args.admin_token)
    trainer = Trainer(args.hidden, args.vocab, args.lr, args.seed)
    published = {}  # policy version -> determinism key

    # The frozen reference and the first policy: a server started here
    # serves both from its flags (version 1); running ones (every replica)
    # get the first policy (and a reference, when they have none) uploaded.
    # The trainer names each version's number, so replicas number alike.
    if started_here:
        info = client.info(model="policy")
        published[info.model_version] = info.determinism_key
    else:
        if not highest_version(args, target, "reference"):
            client.upload_model("reference", trainer.weight, trainer.bias, version=1)
        first = client.upload_model(
            "policy",
            trainer.weight,
            trainer.bias,
            version=highest_version(args, target, "policy") + 1,
        )
        published[first.version] = first.determinism_key

    stop = threading.Event()
    records, errors = [], []
    workers = [
        threading.Thread(target=rollout, args=(w, client, args, stop, records, errors))
        for w in range(args.workers)
    ]
    for thread in workers:
        thread.start()
    began = time.monotonic()
    upload_seconds = []
    try:
        for step in range(args.steps):
            time.sleep(args.step_interval)
            trainer.step()
            t0 = time.monotonic()
            result = client.upload_model(
                "policy", trainer.weight, trainer.bias, version=max(published) + 1
            )
            upload_seconds.append(time.monotonic() - t0)
            published[result.version] = result.determinism_key
            print(
                f"step {step + 1}/{args.steps}: policy version {result.version} "
                f"({result.determinism_key}), {len(records)} answers so far",
                flush=True,
            )
        time.sleep(args.step_interval)
    finally:
        stop.set()
        for thread in workers:
            thread.join()
    train_seconds = time.monotonic() - began
    if errors:
        print(f"rollout worker failed: {errors[0]!r}", file=sys.stderr)
        return 1

    # Every answer again, pinned to the version it named.
    mismatches, key_mismatches, retired = 0, 0, 0
    per_version = collections.Counter()
    for record in records:
        per_version[(record.model, record.version)] += 1
        if record.model == "policy" and published.get(record.version, record.key) != record.key:
            key_mismatches += 1
        try:
            again = client.logprobs(
                record.hidden, record.targets, model=record.model, version=record.version
            )
        except detlogp.NotFound:
            retired += 1  # the server no longer holds that version
            continue
        if (
            again.model_version != record.version
            or again.determinism_key != record.key
            or again.logprobs.tobytes() != record.logprobs.tobytes()
        ):
            mismatches += 1
            if mismatches <= 5:
                print(
                    f"MISMATCH worker {record.worker} {record.model} v{record.version}: "
                    f"{record.logprobs[:4]} then {again.logprobs[:4]}",
                    file=sys.stderr,
                )
    client.close()

    policy_versions = sorted(v for (m, v) in per_version if m == "policy")
    print(
        f"\n{args.steps} policy updates of a [{args.vocab}, {args.hidden}] lm_head, "
        f"{args.workers} rollout workers, {train_seconds:.2f}s "
        f"(uploads: mean {1e3 * np.mean(upload_seconds):.1f} ms)"
    )
    print(
        f"answers recorded: {len(records)} "
        f"({sum(len(r.targets) for r in records)} rows); policy versions answered: "
        f"{policy_versions}"
    )
    for (model, version), count in sorted(per_version.items()):
        print(f"  {model:9} v{version:<3d} {count:5d} answers")
    print(
        f"re-scored pinned to the answered version: {len(records) - retired}; "
        f"{mismatches} mismatches, {key_mismatches} keys differing from the upload's"
    )
    if retired:
        print(
            f"FAILED: {retired} answers named versions the server no longer holds; "
            "give it --max_versions_per_model >= steps + 1",
            file=sys.stderr,
        )
    if mismatches or key_mismatches:
        print("FAILED: an answer's version did not name its bits", file=sys.stderr)
    if retired or mismatches or key_mismatches:
        return 1
    print("OK: every answer is reproduced bit for bit by its version")
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.target:
        return run(args, args.target, started_here=False)
    binary = (
        pathlib.Path(args.server)
        if args.server
        else find_server_binary(pathlib.Path(__file__).resolve().parent)
    )
    if binary is None or not binary.exists():
        print(
            "no server binary: run `bazel build //server:detlogp_server`, or pass "
            "--server or --target",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="toy-rl-") as folder:
        # The first policy and the reference: the same initial weights.
        start = Trainer(args.hidden, args.vocab, args.lr, args.seed)
        path = pathlib.Path(folder) / "initial.safetensors"
        safetensors_io.write(path, {"lm_head.weight": start.weight, "lm_head.bias": start.bias})
        flags = [
            f"--model=policy={path}",
            f"--model=reference={path}",
            "--bias_tensor=lm_head.bias",
            f"--device={args.device}",
            f"--max_versions_per_model={args.steps + 2}",
        ]
        with LocalServer(binary, flags, start_timeout=300.0) as server:
            print(f"started {binary} on {server.target} ({args.device})", flush=True)
            return run(args, server.target, started_here=True)


if __name__ == "__main__":
    sys.exit(main())
