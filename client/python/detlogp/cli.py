"""The `detlogp` console command.

    detlogp info   --target HOST:PORT[,HOST:PORT...] [--model M] [--version N]
    detlogp score  --target HOST:PORT --rows 4 --seed 1 [--lse] [--timing] [--json]
                   [--entropy] [--top-k 5]
    detlogp score  --target HOST:PORT --hidden h.npy --targets t.npy
                   [--model M] [--version N]
    detlogp models --target HOST:PORT                        (admin)
    detlogp load   NAME PATH [--bias-tensor lm_head.bias] [--vocab-size V]
                   [--sha256 HEX] [--version N]              (admin)
    detlogp upload NAME CHECKPOINT_DIR|FILE.safetensors|FILE.npy
                   [--lm-head-tensor T] [--bias-tensor T | --bias b.npy]
                   [--vocab-size V] [--chunk-mb 4] [--version N]  (admin)
                   [--base-version N --base-file FILE] [--fanout chain|direct]
    detlogp unload NAME VERSION                              (admin)

Admin commands (ModelRepositoryService) send --admin-token (or
$DETLOGP_ADMIN_TOKEN); scoring sends --token (or $DETLOGP_TOKEN). With
several targets, load/upload/unload act on every one. `load` reads PATH
relative to the server's --model_root; `upload` sends a local Hugging Face
checkpoint directory or .safetensors file (head lm_head.weight, else the tied
input embedding, or --lm-head-tensor; bias lm_head.bias when present, or
--bias-tensor) or a .npy [V_pad, H] (float32/float16, rounded to bf16, or
uint16 bf16 bits).
"""

import argparse
import json
import os
import sys

import numpy as np

from detlogp.checkpoint import CheckpointError
from detlogp.client import Client
from detlogp.errors import DetlogpError
from detlogp.fleet import Pusher
from detlogp.heap import keep_freed_memory
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.weights import LmHead


def _print(args, fields):
    if args.json:
        print(json.dumps(fields))
    else:
        for key, value in fields.items():
            print(f"{key:18} {value}")


def _info(client, args):
    info = client.info(model=args.model, version=args.version)
    fields = {
        "model": info.model,
        "model_version": info.model_version,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "padded_vocab_size": info.padded_vocab_size,
        "weight_dtype": pb.DType.Name(info.weight_dtype),
        "has_bias": info.has_bias,
        "weights_sha256": info.weights_sha256,
        "backend": info.backend,
        "kernel_version": info.kernel_version,
        "split_policy": info.split_policy,
        "determinism_key": info.determinism_key,
        "versions": [v.version for v in info.versions],
    }
    _print(args, fields)


def _score(client, args):
    if args.hidden:
        hidden = np.load(args.hidden)
        if not args.targets:
            raise SystemExit("--hidden needs --targets")
        targets = np.load(args.targets)
    else:
        info = client.info(model=args.model, version=args.version)
        rng = np.random.default_rng(args.seed)
        hidden = rng.standard_normal((args.rows, info.hidden_size), dtype=np.float32)
        targets = rng.integers(0, info.vocab_size, size=args.rows)
    result = client.logprobs(
        hidden,
        targets,
        temperature=args.temperature,
        return_lse=args.lse,
        model=args.model,
        version=args.version,
        return_entropy=args.entropy,
        top_k=args.top_k,
        timing=args.timing,
    )
    rows = []
    for i, target in enumerate(np.asarray(targets).reshape(-1)):
        row = {"row": i, "target": int(target), "logprob": float(result.logprobs[i])}
        if result.lse is not None:
            row["lse"] = float(result.lse[i])
        if result.entropy is not None:
            row["entropy"] = float(result.entropy[i])
        if result.top_ids is not None:
            row["top_ids"] = [int(t) for t in result.top_ids[i]]
            row["top_logprobs"] = [float(v) for v in result.top_logprobs[i]]
        rows.append(row)
    if args.json:
        print(
            json.dumps(
                {
                    "determinism_key": result.determinism_key,
                    "model": result.model,
                    "model_version": result.model_version,
                    "rows": rows,
                    **({"timings": result.timings.as_dict()} if args.timing else {}),
                }
            )
        )
    else:
        print(f"determinism_key {result.determinism_key}")
        print(f"model {result.model} version {result.model_version}")
        for row in rows:
            extra = f"  lse {row['lse']:.9g}" if "lse" in row else ""
            if "entropy" in row:
                extra += f"  entropy {row['entropy']:.9g}"
            if "top_ids" in row:
                extra += (
                    "  top_ids "
                    + ",".join(map(str, row["top_ids"]))
                    + "  top_logprobs "
                    + ",".join(f"{v:.9g}" for v in row["top_logprobs"])
                )
            print(
                f"row {row['row']:4d}  target {row['target']:8d}  "
                f"logprob {row['logprob']:.9g}{extra}"
            )
        if args.timing:
            t = result.timings
            print(
                f"timing: total {1e3 * t.total_s:.3f} ms: prepare {1e3 * t.prepare_s:.3f}"
                f" + build {1e3 * t.build_s:.3f} + transfer {1e3 * t.transfer_s:.3f}"
                f" + server (validate {1e3 * t.validate_s:.3f}, queue {1e3 * t.queue_s:.3f},"
                f" compute {1e3 * t.compute_s:.3f}) + return {1e3 * t.return_s:.3f} ms;"
                f" {t.slices} slice(s) over {t.connections} connection(s), {t.path}"
            )


def _status_fields(status):
    return {
        "version": status.version,
        "state": pb.ModelVersionStatus.State.Name(status.state),
        "weights_sha256": status.weights_sha256,
        "determinism_key": status.determinism_key,
        "hidden_size": status.hidden_size,
        "vocab_size": status.vocab_size,
        "padded_vocab_size": status.padded_vocab_size,
        "has_bias": status.has_bias,
        "memory_bytes": status.memory_bytes,
        "source": status.source,
        "persisted": status.persisted,
        "requests_in_flight": status.requests_in_flight,
    }


def _models(client, args):
    listing = client.list_models()
    if args.json:
        print(
            json.dumps(
                {
                    "default_model": listing.default_model,
                    "models": {
                        m.model: [_status_fields(v) for v in m.versions] for m in listing.models
                    },
                }
            )
        )
        return
    print(f"default model: {listing.default_model}")
    for model in listing.models:
        print(
            f"{model.model}  (H={model.hidden_size}, V={model.vocab_size}, "
            f"V_pad={model.padded_vocab_size})"
        )
        for v in model.versions:
            state = pb.ModelVersionStatus.State.Name(v.state)
            print(
                f"  v{v.version:<5d} {state:9} {v.determinism_key}  "
                f"sha256 {v.weights_sha256[:16]}  {v.memory_bytes} B  "
                f"in flight {v.requests_in_flight}  {v.source}"
            )


def _published(args, result):
    fields = {
        "model": result.model,
        "version": result.version,
        "weights_sha256": result.weights_sha256,
        "determinism_key": result.determinism_key,
        "targets": list(result.per_target),
    }
    _print(args, fields)


def _load(client, args):
    result = client.load_model(
        args.name,
        args.path,
        args.lm_head_tensor,
        args.bias_tensor,
        args.vocab_size,
        args.sha256,
        version=args.version,
    )
    _published(args, result)


def _read_upload(args):
    """The LmHead from the path named on the command line: a .npy [V_pad, H]
    (bias from --bias b.npy), or a checkpoint directory or .safetensors file
    (its head found as the server finds it)."""
    path = args.file
    if path.endswith(".npy"):
        if args.bias_tensor or args.lm_head_tensor:
            raise SystemExit(
                "--lm-head-tensor and --bias-tensor apply to checkpoints; use --bias b.npy"
            )
        weight = np.load(path, mmap_mode="r")
        bias = np.load(args.bias, mmap_mode="r") if args.bias else None
        return LmHead(weight, bias, args.vocab_size)
    if args.bias and args.bias_tensor:
        raise SystemExit("give --bias or --bias-tensor, not both")
    try:
        head = LmHead.from_checkpoint(path, args.lm_head_tensor, args.bias_tensor, args.vocab_size)
    except (CheckpointError, OSError, KeyError, ValueError) as e:
        raise SystemExit(str(e)) from None
    print(f"lm_head: {head.source}", file=sys.stderr)
    if args.bias:
        head = LmHead(head.weight, np.load(args.bias, mmap_mode="r"), args.vocab_size)
    return head


def _upload(client, args):
    """Through detlogp.fleet.Pusher: one version number on every target,
    and a delta when --base-version and --base-file are given."""
    head = _read_upload(args)
    if (args.base_version is None) != (args.base_file is None):
        raise SystemExit("a delta needs --base-version and --base-file (that version's weights)")
    base = None
    if args.base_file is not None:
        base_args = argparse.Namespace(**{**vars(args), "file": args.base_file})
        base = _read_upload(base_args)
    fanout = args.fanout or ("chain" if len(client.targets) > 2 else "direct")
    with Pusher(
        client.targets,
        args.admin_token,
        timeout=args.admin_timeout,
        chunk_bytes=int(args.chunk_mb * (1 << 20)),
        fanout=fanout,
    ) as pusher:
        result = pusher.upload_model(
            args.name,
            head,
            version=args.version,
            base_version=args.base_version or 0,
            base_weights=base,
        )
        for target, (kind, sent) in pusher.last_sent.items():
            print(f"{target}: sent {kind}, {sent} bytes", file=sys.stderr)
    _published(args, result)


def _unload(client, args):
    client.unload_model(args.name, args.version)
    _print(args, {"model": args.name, "unloaded_version": args.version})


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="detlogp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target", default="127.0.0.1:50051", help="host:port, or several separated by commas"
    )
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument(
        "--admin-timeout", type=float, default=600.0, help="seconds for load/upload/unload"
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("DETLOGP_TOKEN"),
        help="bearer token for scoring ($DETLOGP_TOKEN)",
    )
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("DETLOGP_ADMIN_TOKEN"),
        help="bearer token for admin commands ($DETLOGP_ADMIN_TOKEN)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_flags(command):
        command.add_argument("--model", help="model name (default: the server's)")
        command.add_argument("--version", type=int, help="model version (default: latest)")

    model_flags(sub.add_parser("info", help="a model and its determinism key"))
    score = sub.add_parser("score", help="log p(target) for rows")
    score.add_argument("--rows", type=int, default=4, help="random rows to score")
    score.add_argument("--seed", type=int, default=0)
    score.add_argument("--hidden", help=".npy [N, H] (float32/float16/uint16 bf16)")
    score.add_argument("--targets", help=".npy [N] int target ids")
    score.add_argument("--temperature", type=float, default=0.0)
    score.add_argument("--lse", action="store_true", help="also print logsumexp")
    score.add_argument(
        "--entropy", action="store_true", help="also print each row's entropy (nats)"
    )
    score.add_argument(
        "--top-k", type=int, default=0, help="also print each row's top-k tokens and log-probs"
    )
    score.add_argument(
        "--timing",
        action="store_true",
        help="also print where the call's time went (client, transfer, server queue/compute)",
    )
    model_flags(score)
    sub.add_parser("models", help="every model and its versions (admin)")
    load = sub.add_parser("load", help="load a file under the server's --model_root (admin)")
    load.add_argument("name")
    load.add_argument(
        "path", help="checkpoint directory or .safetensors, relative to the server's --model_root"
    )
    load.add_argument(
        "--lm-head-tensor", help="default lm_head.weight, else the tied input embedding"
    )
    load.add_argument("--bias-tensor", help="default lm_head.bias when present")
    load.add_argument("--vocab-size", type=int, help="real vocabulary (default: all rows)")
    load.add_argument("--sha256", help="the weights' expected digest")
    load.add_argument(
        "--version", type=int, help="version number to publish as (default: the next)"
    )
    upload = sub.add_parser("upload", help="send a local lm_head as a new version (admin)")
    upload.add_argument("name")
    upload.add_argument("file", help="checkpoint directory, .safetensors file, or .npy [V_pad, H]")
    upload.add_argument(
        "--lm-head-tensor", help="default lm_head.weight, else the tied input embedding"
    )
    upload.add_argument("--bias-tensor", help="default lm_head.bias when present")
    upload.add_argument("--bias", help=".npy [V_pad] bias")
    upload.add_argument("--vocab-size", type=int, help="real vocabulary (default: all rows)")
    upload.add_argument("--chunk-mb", type=float, default=4.0)
    upload.add_argument(
        "--version",
        type=int,
        help="version number to publish as (default: one above the highest any target has)",
    )
    upload.add_argument(
        "--base-version", type=int, help="send only what changed against this version"
    )
    upload.add_argument("--base-file", help="the weights of --base-version (read as FILE is)")
    upload.add_argument(
        "--fanout",
        choices=("chain", "direct"),
        help="several targets: each forwards to the next, or every one from here "
        "(default: chain for more than two)",
    )
    unload = sub.add_parser("unload", help="unload one version (admin)")
    unload.add_argument("name")
    unload.add_argument("version", type=int)
    args = parser.parse_args(argv)
    if args.command in ("score", "upload"):
        # The console is a program: it may let malloc reuse the large
        # requests' buffers (process-wide; see detlogp/heap.py).
        keep_freed_memory()
    commands = {
        "info": _info,
        "score": _score,
        "models": _models,
        "load": _load,
        "upload": _upload,
        "unload": _unload,
    }
    try:
        with Client(
            args.target,
            timeout=args.timeout,
            token=args.token,
            admin_token=args.admin_token,
            admin_timeout=args.admin_timeout,
        ) as client:
            commands[args.command](client, args)
    except DetlogpError as error:
        print(f"detlogp: {error}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError) as error:
        print(f"detlogp: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
