"""One GRPO-style step where the rollout's log-probs come from the detlogp
server and the trainer's forward from detlogp.torch on the same hidden
states: the importance ratio exp(logp_train - logp_rollout) is exactly 1.0
for every token, printed beside the same step with PyTorch eager on the
trainer side (bf16 logits -> float -> log_softmax), whose mismatch is what RL
frameworks log every step.

    python examples/grpo_twin_step.py --target 127.0.0.1:50051 \\
        --weights /m/qwen                 # a checkpoint directory or .safetensors
    python examples/grpo_twin_step.py --target 127.0.0.1:50051 \\
        --weights /m/qwen --trunk         # hidden states from the model itself

The server must serve those weights (its determinism key is checked against
detlogp.ops.determinism_key). With a CUDA server run this on a GPU (the CUDA
ops); with a CPU server on the CPU (--device cpu). Without --target it
starts nothing and compares against detlogp.ops on the same device instead.
With --trunk the hidden states are the final hidden states of the
checkpoint's own transformers model (hf_checkpoint.py runs the same step
after checking them against the model's logits); without it, random rows.
"""

import argparse

import detlogp
import detlogp.torch as dtorch
import numpy as np
import torch
from detlogp import ops


def run_step(hidden, head, tokens, rollout, *, group, device):
    """One GRPO step on bf16 hidden [n, H] for `tokens` [n] whose rollout
    log-probs were `rollout` [n], with the twin op and with PyTorch eager;
    prints both and returns how many tokens had ratio == 1.0 with the twin."""
    weight_bits = np.array(head.weight)  # writable, for torch
    weight = torch.from_numpy(weight_bits.view(np.int16)).view(torch.bfloat16).to(device)
    bias_t = None if head.bias is None else torch.from_numpy(np.array(head.bias)).to(device)
    vocab = head.vocab_size or head.padded_vocab_size
    hidden, tokens, rollout = hidden.to(device), tokens.to(device), rollout.to(device)
    n = hidden.shape[0]

    # Group-relative advantages from a stand-in reward.
    rng = np.random.default_rng(1)
    reward = torch.from_numpy(rng.standard_normal(group).astype(np.float32)).to(device)
    adv = ((reward - reward.mean()) / (reward.std() + 1e-6)).repeat_interleave(n // group)

    def step(name, trainer_logp, weight_param):
        ratio = torch.exp(trainer_logp - rollout)
        loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)).mean()
        loss.backward()
        r = ratio.detach().double()
        ones = int((r == 1.0).sum())
        print(
            f"{name:>16}: ratio == 1.0 for {ones}/{n} tokens, "
            f"max |ratio - 1| = {float((r - 1).abs().max()):.3e}, "
            f"|grad W| = {float(weight_param.grad.float().norm()):.4e}"
        )
        return ones

    w1 = weight.clone().requires_grad_()
    twin = step(
        "detlogp.torch", dtorch.linear_logp(hidden, w1, tokens, bias_t, vocab_size=vocab), w1
    )
    w2 = weight.clone().requires_grad_()
    logits = (hidden @ w2[:vocab].T).float()
    if bias_t is not None:
        logits = logits + bias_t[:vocab]
    eager = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    step("PyTorch eager", eager, w2)
    return twin


def trunk_hidden(model_dir, sequences, length, vocab, rng):
    """Final hidden states [n, H] (bf16) of the checkpoint's own model on
    random token sequences, and each position's next token."""
    import transformers  # only with --trunk

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.from_numpy(rng.integers(0, vocab, (sequences, length + 1)))
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], output_hidden_states=True)
    hidden = out.hidden_states[-1].reshape(sequences * length, -1)
    return hidden.to(torch.bfloat16), ids[:, 1:].reshape(-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="host:port of a detlogp server")
    parser.add_argument(
        "--weights", required=True, help="checkpoint directory or .safetensors with the lm_head"
    )
    parser.add_argument("--lm_head_tensor", default=None)
    parser.add_argument("--bias_tensor", default=None)
    parser.add_argument("--vocab_size", type=int, default=None)
    parser.add_argument("--trunk", action="store_true", help="hidden states from the model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    args = parser.parse_args()

    head = detlogp.LmHead.from_checkpoint(
        args.weights, args.lm_head_tensor, args.bias_tensor, args.vocab_size
    )
    print(f"lm_head: {head.source}")
    vocab = head.vocab_size or head.padded_vocab_size
    device = torch.device(args.device)
    rng = np.random.default_rng(0)
    n = args.group * args.tokens
    if args.trunk:
        hidden, tokens = trunk_hidden(args.weights, args.group, args.tokens, vocab, rng)
    else:  # a stand-in for the model's forward
        hidden = torch.from_numpy(rng.standard_normal((n, head.hidden_size), dtype=np.float32))
        hidden = hidden.to(torch.bfloat16)
        tokens = torch.from_numpy(rng.integers(0, vocab, n))
    hidden = hidden.to(device)

    # Rollout: the server's log-probs (what the sampler saw).
    if args.target:
        hidden_bits = hidden.cpu().view(torch.int16).numpy().view(np.uint16)
        with detlogp.Client(args.target) as client:
            served = client.logprobs(hidden_bits, tokens.numpy(), temperature=1.0)
        want_key = ops.determinism_key(head.weight, head.bias, vocab, device=device.type)
        if served.determinism_key != want_key:
            raise SystemExit(
                f"the server's determinism key {served.determinism_key} is not "
                f"this device's key for these weights ({want_key}): serve the "
                f"same weights on a {device.type} server"
            )
        rollout = torch.from_numpy(served.logprobs)
    else:
        weight = torch.from_numpy(np.array(head.weight).view(np.int16)).view(torch.bfloat16)
        bias_t = None if head.bias is None else torch.from_numpy(np.array(head.bias)).to(device)
        rollout = torch.as_tensor(
            ops.linear_logp(hidden, weight.to(device), tokens.to(device), bias_t, vocab_size=vocab)
        )
    run_step(hidden, head, tokens, rollout.cpu(), group=args.group, device=device)


if __name__ == "__main__":
    main()
