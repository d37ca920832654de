"""Two-phase publish from Python (detlogp.fleet.Pusher, detlogp.Client)
against real CPU servers, without deltas (no zstandard needed): a replica
that fails to stage a version aborts the push on every replica, and a push
commits one number and digest everywhere.
"""

import asyncio

import detlogp
import detlogp.aio
import grpc
import numpy as np
import pytest
from detlogp.fleet import Pusher
from detlogp.testing import LocalServer, TestModel
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc


def step(bits, seed, fraction=0.04):
    """~fraction of the bf16 elements moved by one step (the last bit)."""
    rng = np.random.default_rng(seed)
    return bits ^ (rng.random(bits.shape) < fraction).astype(np.uint16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return TestModel(tmp_path_factory.mktemp("publish"), hidden=64, vocab=1024, padded_vocab=1024)


def start(server_binary, model, extra=()):
    return LocalServer(server_binary, model.flags + ["--cpu_threads=1", *extra], metrics=True)


def bits_on(server, version, model):
    hidden, targets = model.random_rows(8, seed=3)
    with detlogp.Client(server.target, timeout=20.0) as client:
        result = client.logprobs(hidden, targets, version=version, return_lse=True)
    assert result.model_version == version
    return np.asarray(result.logprobs).view(np.uint32).tolist()


def versions_on(server):
    """{version: (state, digest)} of model "default" on `server`."""
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.ModelRepositoryServiceStub(channel)
        models = stub.ListModels(pb.ListModelsRequest(), timeout=20)
    return {
        v.version: (v.state, v.weights_sha256)
        for m in models.models
        if m.model == "default"
        for v in m.versions
    }


def test_two_phase_push_aborts_everywhere_when_one_replica_fails_to_stage(server_binary, model):
    # One version of [1024, 64] bf16 + fp32 bias is 135168 bytes: room for one.
    with (
        start(server_binary, model) as a,
        start(server_binary, model) as b,
        start(server_binary, model, ["--max_model_memory_bytes=200000"]) as full,
    ):
        before = {s.target: versions_on(s) for s in (a, b, full)}
        for fanout in ("direct", "chain"):
            with Pusher([a.target, b.target, full.target], fanout=fanout) as pusher:
                with pytest.raises(detlogp.DetlogpError) as refused:
                    pusher.upload_model("default", step(model.weight_bits, 31), model.bias)
            assert "push aborted" in str(refused.value)
            assert refused.value.per_target[a.target].code == grpc.StatusCode.ABORTED
            assert refused.value.per_target[full.target].code == grpc.StatusCode.RESOURCE_EXHAUSTED
            for server in (a, b, full):
                assert versions_on(server) == before[server.target]  # nothing staged, nothing new
        assert bits_on(a, 1, model) == bits_on(full, 1, model)


def test_client_push_commits_one_number_and_digest_everywhere(server_binary, model):
    with start(server_binary, model) as a, start(server_binary, model) as b:
        new = step(model.weight_bits, 51)
        with detlogp.Client([a.target, b.target], timeout=20.0) as client:
            result = client.upload_model("default", new, model.bias, base_version=0)
        assert result.version == 2
        statuses = list(result.per_target.values())
        assert {s.state for s in statuses} == {pb.ModelVersionStatus.READY}
        assert min(s.ready_unix_micros for s in statuses) > 0
        assert versions_on(a) == versions_on(b)
        assert bits_on(a, 2, model) == bits_on(b, 2, model)


def test_async_client_push_is_two_phase_like_the_sync_one(server_binary, model):
    """AsyncClient.upload_model drives the same Pusher: a replica that cannot
    stage the version aborts the push everywhere; a push that stages
    everywhere commits one number and digest on every replica."""

    async def push(targets, weights):
        async with detlogp.aio.AsyncClient(targets, timeout=20.0) as client:
            return await client.upload_model("default", weights, model.bias, base_version=0)

    with (
        start(server_binary, model) as a,
        start(server_binary, model) as b,
        start(server_binary, model, ["--max_model_memory_bytes=200000"]) as full,
    ):
        before = {s.target: versions_on(s) for s in (a, b, full)}
        with pytest.raises(detlogp.DetlogpError) as refused:
            asyncio.run(push([a.target, b.target, full.target], step(model.weight_bits, 61)))
        assert "push aborted" in str(refused.value)
        assert refused.value.per_target[b.target].code == grpc.StatusCode.ABORTED
        assert refused.value.per_target[full.target].code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for server in (a, b, full):
            assert versions_on(server) == before[server.target]

        result = asyncio.run(push([a.target, b.target], step(model.weight_bits, 62)))
        statuses = list(result.per_target.values())
        assert {s.state for s in statuses} == {pb.ModelVersionStatus.READY}
        assert {s.version for s in statuses} == {result.version}
        assert versions_on(a) == versions_on(b)
        assert bits_on(a, result.version, model) == bits_on(b, result.version, model)
