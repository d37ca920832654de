"""examples/toy_rl_loop.py runs end to end for a few steps: uploads under
load, every answer re-scored pinned to its version with identical bits."""

import re
import subprocess
import sys


def test_toy_rl_loop_reproduces_every_answer(repo_root, server_binary):
    script = repo_root / "examples" / "toy_rl_loop.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--server",
            str(server_binary),
            "--steps",
            "3",
            "--hidden",
            "64",
            "--vocab",
            "1000",
            "--workers",
            "2",
            "--rows",
            "4",
            "--step-interval",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(out.stdout[-2000:])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "0 mismatches, 0 keys differing" in out.stdout
    versions = re.search(r"policy versions answered: \[([\d, ]+)\]", out.stdout).group(1)
    assert len(versions.split(",")) >= 2, "the workers never saw a swap"
    recorded = int(re.search(r"answers recorded: (\d+)", out.stdout).group(1))
    rescored = int(
        re.search(r"re-scored pinned to the answered version: (\d+)", out.stdout).group(1)
    )
    assert recorded == rescored > 0
