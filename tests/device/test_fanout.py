"""fanout: one push to 8 servers on one GPU host, every server on cuda:0,
a 1.24 GB head (H = 4096, V = 151936 bf16; fanout_push.py). One server
alone first, then a chain of 8: the chain's last replica must be ready
within the gate's multiple of one server's time, and the pusher must send
the head about once (`detlogp_model_bytes_received_total{from="pusher"}`
summed over the servers). DETLOGP_FANOUT_ARGS="..." replaces the bench's
arguments, split as a shell would."""

import os
import shlex

import pytest
from gates import FANOUT_CHAIN_OVER_ONE_MAX, FANOUT_PUSHER_BYTES_OVER_HEAD_MAX, at_most

pytestmark = pytest.mark.fanout

FANOUT_ARGS = shlex.split(
    os.environ.get(
        "DETLOGP_FANOUT_ARGS",
        "--servers 8 --hidden 4096 --vocab 151936 --device cuda:0 --pushes one,chain",
    )
)


def test_a_chain_push_reaches_every_replica_near_one_replicas_time(bundle, out, run, figures):
    report = out / "fanout.json"
    lines = run(
        "fanout_push",
        ["python3", bundle.script("fanout_push.py"), f"--json_out={report}", *FANOUT_ARGS],
        timeout_s=600,
        json_path=report,
        env={"DETLOGP_SERVER": str(bundle.server)},
    )
    figures["pushes"] = lines
    by_push = {line["push"]: line for line in lines}
    assert {"one", "chain"} <= set(by_push), f"{report} lacks the one or chain push"
    chain, one = by_push["chain"], by_push["one"]
    at_most(
        f"chain of {chain['servers']}: pusher bytes / head",
        chain["from_pusher_over_head"],
        FANOUT_PUSHER_BYTES_OVER_HEAD_MAX,
    )
    at_most(
        f"chain of {chain['servers']}: last ready / one server's time",
        chain["last_ready_s"] / one["last_ready_s"],
        FANOUT_CHAIN_OVER_ONE_MAX,
    )
