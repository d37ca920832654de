"""A Hugging Face causal LM served from its checkpoint directory: the model's
final hidden states scored by the server loaded from the same directory,
against log_softmax of the model's own logits in float64; then the GRPO twin
step (grpo_twin_step.py) on that model's trunk, where the importance ratio is
exactly 1.0 on real hidden states.

    python examples/hf_checkpoint.py                     # a small random Qwen2
    python examples/hf_checkpoint.py --model_dir /m/Qwen2.5-0.5B
    python examples/hf_checkpoint.py --model_dir DIR --target host:port
    python examples/hf_checkpoint.py --device cuda      # server and twin on a GPU

Without --target the script starts bazel-bin/server/detlogp_server (or
--server) with --weights=<the checkpoint directory>; a server given with
--target must serve that directory as its default model (--weights=DIR, or
--model=NAME=DIR with --model_name NAME). Without --model_dir a small random
Qwen2 (tied embeddings with --tied) is written with save_pretrained into a
temporary directory, in shards with model.safetensors.index.json.

What is compared, for each position of a few sequences:
  * the server's log p(next token) against float64 log-softmax of the same
    bf16 inputs (the hidden state rounded to bf16, the head's bf16 rows):
    the server accumulates in fp32, so these agree to ~1e-6 nats;
  * the same against log_softmax(logits.double()) of the model's own
    forward: these differ by the rounding of the hidden state to bf16 (the
    server's input type), about 1e-3 nats on the small random model and up
    to about 1e-2 nats on a real checkpoint; the bound checked is
    --model_tolerance (default 0.05 nats).

The hidden states are outputs.hidden_states[-1], which in the Qwen, Llama
and Mistral families is already the final norm's output (what lm_head
reads). For another family, check it the way this script does: the head
applied to hidden_states[-1] must give the model's logits exactly; if it
does not, hidden_states[-1] is before the final norm, and the input to the
head is model.get_output_embeddings()'s input (a forward hook on it).
"""

import argparse
import pathlib
import sys
import tempfile

import detlogp
import numpy as np
import torch
import transformers
from detlogp import ops
from detlogp.testing import LocalServer, find_server_binary

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import grpo_twin_step  # noqa: E402  (the sibling example)


def write_random_qwen2(folder, tied, seed):
    """A small random Qwen2ForCausalLM saved in bf16 shards."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    # Small shards: the head lands in one of several files, found through
    # model.safetensors.index.json.
    model.save_pretrained(folder, max_shard_size="200KB")
    return folder


def final_hidden_states(model, input_ids):
    """(hidden [B, T, H] float32, logits [B, T, V]) of one forward, checking
    that the head applied to the hidden states gives the logits."""
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        head = model.get_output_embeddings()
        if not torch.equal(head(hidden), out.logits):
            raise SystemExit(
                "the head applied to hidden_states[-1] does not give the model's "
                "logits: for this family hidden_states[-1] is not the head's "
                "input (see the module docstring)"
            )
    return hidden.float(), out.logits


def float64_logprobs(hidden_bf16, weight_bits, bias, targets):
    """log p(target) in float64 from bf16 hidden rows and bf16 head rows."""
    h = hidden_bf16.astype(np.float64)
    w = (weight_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    logits = h @ w.T
    if bias is not None:
        logits += bias.astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return logits[np.arange(len(targets)), targets] - lse


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", help="a Hugging Face checkpoint directory")
    parser.add_argument("--tied", action="store_true", help="random model: tied embeddings")
    parser.add_argument("--target", help="host:port of a server serving --model_dir")
    parser.add_argument("--model_name", default=None, help="the model's name on --target")
    parser.add_argument("--server", help="detlogp_server binary (default: bazel-bin's)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model_tolerance", type=float, default=0.05)
    parser.add_argument("--save_to", help="random model: write it here (kept)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the server started here runs and the twin op runs (a "
        "--target server must be of the same kind: the determinism keys are checked)",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="hf-checkpoint-") as scratch:
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = write_random_qwen2(args.save_to or scratch, args.tied, args.seed)
            print(f"wrote a random Qwen2 (tied={args.tied}) to {model_dir}")
        head = detlogp.LmHead.from_checkpoint(model_dir)
        print(f"lm_head: {head.source}")
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()

        rng = np.random.default_rng(args.seed)
        vocab = head.padded_vocab_size
        ids = torch.from_numpy(rng.integers(0, vocab, (args.sequences, args.length + 1)))
        hidden, logits = final_hidden_states(model, ids[:, :-1])
        rows = hidden.reshape(-1, hidden.shape[-1])
        targets = ids[:, 1:].reshape(-1).numpy()
        hidden_bits = rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

        if args.target:
            got = score(args.target, args.model_name, hidden_bits, targets)
        else:
            binary = args.server or find_server_binary(pathlib.Path(__file__).parent)
            if binary is None:
                raise SystemExit("no server binary: bazel build //server:detlogp_server")
            server_device = "cpu" if args.device == "cpu" else "cuda:0"
            flags = [f"--weights={model_dir}", f"--device={server_device}"]
            with LocalServer(binary, flags, start_timeout=300.0) as server:
                got = score(server.target, None, hidden_bits, targets)

        bf16_rows = (hidden_bits.astype(np.uint32) << 16).view(np.float32)
        same_inputs = float64_logprobs(bf16_rows, head.weight, head.bias, targets)
        own = torch.log_softmax(logits.double(), dim=-1)
        own = own.reshape(-1, own.shape[-1])[np.arange(len(targets)), targets].numpy()
        served = got.logprobs.astype(np.float64)
        vs_inputs = float(np.abs(served - same_inputs).max())
        vs_model = float(np.abs(served - own).max())
        print(f"scored {len(targets)} positions (model version {got.model_version})")
        print(f"max |server - float64 of the same bf16 inputs| = {vs_inputs:.3e} nats")
        print(f"max |server - the model's own log_softmax, float64| = {vs_model:.3e} nats")
        if vs_inputs > 1e-4:
            raise SystemExit(f"the server is {vs_inputs} nats from float64 on its own inputs")
        if vs_model > args.model_tolerance:
            raise SystemExit(f"the server is {vs_model} nats from the model's own log-probs")

        # The GRPO step on this model's trunk: the rollout's log-probs are the
        # server's answer above, the trainer's the twin op on the same rows,
        # on a device whose bits are the server's (equal keys, equal bits).
        vocab_size = head.vocab_size or head.padded_vocab_size
        want_key = ops.determinism_key(head.weight, head.bias, vocab_size, device=args.device)
        if got.determinism_key != want_key:
            raise SystemExit(
                f"the server's determinism key {got.determinism_key} is not the "
                f"{args.device} twin's ({want_key}): run the twin where the server "
                "runs (--device)"
            )
        print("GRPO twin step on the model's final hidden states:")
        ratio_ones = grpo_twin_step.run_step(
            rows.to(torch.bfloat16),
            head,
            torch.from_numpy(targets),
            torch.from_numpy(got.logprobs),
            group=args.sequences,
            device=torch.device(args.device),
        )
        if ratio_ones != len(targets):
            raise SystemExit(f"ratio == 1.0 for only {ratio_ones}/{len(targets)} tokens")
        print("ok")
    return 0


def score(target, model, hidden_bits, targets):
    with detlogp.Client(target, timeout=120.0) as client:
        return client.logprobs(hidden_bits, targets, temperature=1.0, model=model)


if __name__ == "__main__":
    sys.exit(main())
