"""examples/hf_checkpoint.py end to end on a small random Qwen2 written by
transformers' save_pretrained (sharded, then tied): the server loaded from
the checkpoint directory agrees with float64 on its own bf16 inputs and with
the model's own log_softmax, and the GRPO twin step on the model's final
hidden states has ratio exactly 1.0 for every token. Needs transformers and
torch (and the CPU ops library for detlogp.torch)."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
def test_hf_checkpoint_example(repo_root, server_binary, tmp_path, tied):
    script = repo_root / "examples" / "hf_checkpoint.py"
    cmd = [sys.executable, str(script), "--server", str(server_binary)]
    cmd += ["--save_to", str(tmp_path), "--sequences", "4", "--length", "16"]
    if tied:
        cmd.append("--tied")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo_root)
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Written the way save_pretrained writes a sharded checkpoint.
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert (tmp_path / "config.json").exists()
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert f"lm_head: {head} (BF16 [1024, 128]" in out.stdout
    vs_inputs = float(re.search(r"same bf16 inputs\| = (\S+) nats", out.stdout).group(1))
    assert vs_inputs <= 1e-4
    assert "detlogp.torch: ratio == 1.0 for 64/64 tokens" in out.stdout
    assert out.stdout.rstrip().endswith("ok")
