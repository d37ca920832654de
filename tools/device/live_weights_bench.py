"""Times live-weight changes from the Python client on a GPU host.

    python3 tools/device/live_weights_bench.py --target 127.0.0.1:PORT \
        --model_root /tmp/root --repeats 3

1. upload: a bf16 torch tensor on the GPU (H=4096, V=151936: 1.24 GB) and the
   same weight as a numpy uint16 view, each pushed whole with
   client.upload_model(base_version=0) (never a delta);
   "prepare" is the client's work before the first byte (leaving the GPU,
   the digest), "upload" the time from the first byte to the call's return
   (uploaded, digest checked, on the GPU, warmed up, persisted when
   --model_root is set);
2. load: a .safetensors file written under --model_root, loaded with
   client.load_model; the time from the call to its return;
3. each new version answers with its own key, and re-scoring a row pinned to
   a version gives the bits its first answer had.
Prints one JSON line per measurement and a summary table.
"""

import argparse
import json
import os
import statistics
import sys
import time

import detlogp
import detlogp.weights
import numpy as np
import torch


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def prepared(weight):
    """The upload as the client sends it, digest computed."""
    head = detlogp.weights.LmHead(weight)
    head.sha256()
    return head


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--model_root", required=True)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    client = detlogp.Client(args.target, timeout=120.0)
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda") * 0.02).to(torch.bfloat16)
    gigabytes = weight.numel() * 2 / 1e9
    rows = np.random.default_rng(1).standard_normal((8, args.hidden), dtype=np.float32)
    targets = list(range(0, 8 * 997, 997))
    results = {
        "prepare_torch_cuda_s": [],
        "upload_torch_cuda_s": [],
        "prepare_numpy_s": [],
        "upload_numpy_s": [],
        "load_file_s": [],
    }
    answers = []  # (version, logprobs)

    for repeat in range(args.repeats):
        weight[repeat % args.vocab, 0] += 1  # a new digest each time
        seconds, head = timed(lambda: prepared(weight))
        results["prepare_torch_cuda_s"].append(seconds)
        seconds, pushed = timed(lambda: client.upload_model("policy", head, base_version=0))
        results["upload_torch_cuda_s"].append(seconds)
        print(
            json.dumps(
                {
                    "what": "upload torch cuda bf16",
                    "gb": gigabytes,
                    "seconds": seconds,
                    "version": pushed.version,
                    "key": pushed.determinism_key,
                }
            ),
            flush=True,
        )
        r = client.logprobs(rows, targets, model="policy", version=pushed.version)
        answers.append((pushed.version, r.logprobs.copy()))

        host = weight.cpu().view(torch.int16).numpy().view(np.uint16)
        host[repeat % args.vocab, 1] ^= 1
        seconds, head = timed(lambda: prepared(host))
        results["prepare_numpy_s"].append(seconds)
        seconds, pushed = timed(lambda: client.upload_model("policy", head, base_version=0))
        results["upload_numpy_s"].append(seconds)
        print(
            json.dumps(
                {
                    "what": "upload numpy bf16 bits",
                    "gb": gigabytes,
                    "seconds": seconds,
                    "version": pushed.version,
                }
            ),
            flush=True,
        )

    # A file under the root, loaded by path.
    from safetensors.torch import save_file

    path = os.path.join(args.model_root, "base", "lm_head.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({"lm_head.weight": weight.cpu()}, path)
    os.sync()
    for _ in range(args.repeats):
        seconds, loaded = timed(lambda: client.load_model("reference", "base/lm_head.safetensors"))
        results["load_file_s"].append(seconds)
        print(
            json.dumps(
                {
                    "what": "load from --model_root",
                    "gb": gigabytes,
                    "seconds": seconds,
                    "version": loaded.version,
                }
            ),
            flush=True,
        )

    # Pinned re-scoring of the versions still held gives the same bits.
    held = {
        v.version for m in client.list_models().models if m.model == "policy" for v in m.versions
    }
    same = 0
    for version, logprobs in answers:
        if version in held:
            again = client.logprobs(rows, targets, model="policy", version=version)
            assert again.logprobs.tobytes() == logprobs.tobytes(), f"version {version} changed"
            same += 1
    print(f"re-scored {same} held versions: identical bits")
    print(f"{'what':<34} {'GB':>6} {'median s':>9} {'min s':>7} {'max s':>7}")
    for what, values in results.items():
        print(
            f"{what:<34} {gigabytes:>6.2f} {statistics.median(values):>9.3f} "
            f"{min(values):>7.3f} {max(values):>7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
