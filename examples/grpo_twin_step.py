"""One GRPO-style step where the rollout's log-probs come from the detlogp
server and the trainer's forward from detlogp.torch on the same hidden
states: the importance ratio exp(logp_train - logp_rollout) is
exactly 1.0 for every token, printed beside the same step with PyTorch eager
on the trainer side (bf16 logits -> float -> log_softmax), whose mismatch is
what RL frameworks log every step.

    python examples/grpo_twin_step.py --target 127.0.0.1:50051 \\
        --weights lm_head.safetensors [--bias_tensor lm_head.bias]

The server must serve those weights (its determinism key is checked against
detlogp.ops.determinism_key). With a CUDA server run this on a GPU (the CUDA
ops); with a CPU server on the CPU (--device cpu). Without --target it
starts nothing and compares against detlogp.ops on the same device instead.
"""

import argparse

import detlogp
import detlogp.torch as dtorch
import numpy as np
import torch
from detlogp import ops, safetensors_io


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="host:port of a detlogp server")
    parser.add_argument("--weights", required=True, help="safetensors with the lm_head")
    parser.add_argument("--lm_head_tensor", default="lm_head.weight")
    parser.add_argument("--bias_tensor", default=None)
    parser.add_argument("--vocab_size", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    args = parser.parse_args()

    tensors = safetensors_io.read(args.weights)
    weight_bits = np.array(tensors[args.lm_head_tensor]).view(np.uint16)  # writable
    bias = tensors[args.bias_tensor].astype(np.float32) if args.bias_tensor else None
    vocab = args.vocab_size or weight_bits.shape[0]
    device = torch.device(args.device)
    weight = torch.from_numpy(weight_bits.view(np.int16)).view(torch.bfloat16).to(device)
    bias_t = None if bias is None else torch.from_numpy(bias).to(device)

    # The policy's final hidden states for group x tokens sampled tokens (a
    # stand-in for the model's forward), and the sampled tokens.
    rng = np.random.default_rng(0)
    n = args.group * args.tokens
    hidden = torch.from_numpy(rng.standard_normal((n, weight.shape[1]), dtype=np.float32))
    hidden = hidden.to(torch.bfloat16).to(device)
    tokens = torch.from_numpy(rng.integers(0, vocab, n)).to(device)

    # Rollout: the server's log-probs (what the sampler saw).
    hidden_bits = hidden.cpu().view(torch.int16).numpy().view(np.uint16)
    if args.target:
        with detlogp.Client(args.target) as client:
            served = client.logprobs(hidden_bits, tokens.cpu().numpy(), temperature=1.0)
            key = served.determinism_key
        want_key = ops.determinism_key(weight_bits, bias, vocab, device=device.type)
        if key != want_key:
            raise SystemExit(
                f"the server's determinism key {key} is not this device's "
                f"key for these weights ({want_key}): serve the same "
                f"weights on a {device.type} server"
            )
        rollout = torch.from_numpy(served.logprobs).to(device)
    else:
        rollout = torch.as_tensor(
            ops.linear_logp(hidden, weight, tokens, bias_t, vocab_size=vocab)
        ).to(device)

    # Group-relative advantages from a stand-in reward.
    reward = torch.from_numpy(rng.standard_normal(args.group).astype(np.float32)).to(device)
    adv = ((reward - reward.mean()) / (reward.std() + 1e-6)).repeat_interleave(args.tokens)

    def step(name, trainer_logp, weight_param):
        ratio = torch.exp(trainer_logp - rollout)
        loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)).mean()
        loss.backward()
        r = ratio.detach().double()
        print(
            f"{name:>16}: ratio == 1.0 for {int((r == 1.0).sum())}/{n} tokens, "
            f"max |ratio - 1| = {float((r - 1).abs().max()):.3e}, "
            f"|grad W| = {float(weight_param.grad.float().norm()):.4e}"
        )

    w1 = weight.clone().requires_grad_()
    step("detlogp.torch", dtorch.linear_logp(hidden, w1, tokens, bias_t, vocab_size=vocab), w1)
    w2 = weight.clone().requires_grad_()
    logits = (hidden @ w2[:vocab].T).float()
    if bias_t is not None:
        logits = logits + bias_t[:vocab]
    eager = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    step("PyTorch eager", eager, w2)


if __name__ == "__main__":
    main()
