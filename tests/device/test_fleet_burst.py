"""fleet_burst: many rollout workers at once against one GPU server. W
worker processes, each with its own detlogp.Client and a CUDA bf16 batch,
call logprobs() at the same moment, R rounds (fleet_burst_bench.py, which
exits non-zero when a call fails). Every call must be answered, and the
aggregate rows/s through CUDA regions must reach the gate's share of the
kernel's in the same run. DETLOGP_FLEET_ARGS="..." are the bench's
arguments, split as a shell would (default: 8 workers x 16,384 rows and 32 x 4,096, 3 rounds,
through CUDA regions and through messages)."""

import os
import shlex

import pytest
from gates import FLEET_BURST_OVER_KERNEL_MIN, at_least

pytestmark = pytest.mark.fleet_burst

FLEET_ARGS = shlex.split(os.environ.get("DETLOGP_FLEET_ARGS", ""))


def test_every_call_of_a_burst_is_answered_near_the_kernels_rate(bundle, out, run, figures):
    report = out / "fleet.json"
    lines = run(
        "fleet_burst_bench",
        [
            "python3",
            bundle.script("fleet_burst_bench.py"),
            f"--server={bundle.server}",
            f"--json_out={report}",
            *FLEET_ARGS,
        ],
        timeout_s=900,
        json_path=report,
    )
    assert lines, f"no burst in {report}"
    figures["bursts"] = lines
    for line in lines:
        burst = f"{line['workers']} x {line['rows']} ({line['shared_memory']})"
        assert line["failed"] == 0, f"{burst}: {line['first_failures']}"
        if line["shared_memory"] == "cuda":
            at_least(f"{burst}: aggregate / kernel", line["ratio"], FLEET_BURST_OVER_KERNEL_MIN)
