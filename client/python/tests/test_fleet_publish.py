"""Two-phase publish from Python (detlogp.fleet.Pusher, detlogp.Client)
against real CPU servers, without deltas (no zstandard needed): a replica
that fails to stage a version aborts the push on every replica, and a push
commits one number and digest everywhere; a push to a dns: name reaches
every address the name resolves to.
"""

import asyncio
import threading

import detlogp
import detlogp.aio
import grpc
import numpy as np
import pytest
from detlogp import dns_targets
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


# ---------------------------------------------------------------- dns: names


def test_dns_target_parsing_follows_the_cpp_rules():
    """The cases of the C++ DnsTargetTest (client/target_resolver.h)."""
    parse = dns_targets.parse_dns_target
    assert parse("dns:///detlogp.ns.svc:50051") == ("detlogp.ns.svc", "50051")
    assert parse("dns://8.8.8.8/pods.local:7") == ("pods.local", "7")
    assert parse("dns:[::1]:9") == ("::1", "9")
    assert parse("dns:host:80") == ("host", "80")
    assert parse("127.0.0.1:50051") is None
    for bad in ("dns:///no-port", "dns:///:80", "dns://authority-only", "dns:[::1:9"):
        with pytest.raises(ValueError, match="target: "):
            parse(bad)
    assert dns_targets.resolve_with_getaddrinfo("127.0.0.1", "50051") == ["127.0.0.1:50051"]
    assert dns_targets.resolve_with_getaddrinfo("::1", "7") == ["[::1]:7"]
    with pytest.raises(detlogp.DetlogpError) as unresolved:
        dns_targets.resolve_with_getaddrinfo("no-such-host.invalid", "1")
    assert unresolved.value.code == grpc.StatusCode.UNAVAILABLE


def test_pods_are_ordered_by_ordinal_as_the_cpp_client_orders_them():
    """The cases of the C++ PodsAreOrderedByOrdinalWhenReverseDnsNamesThem."""
    addresses = ["10.0.0.3:7", "10.0.0.5:7", "10.0.0.8:7", "[fd00::1]:7"]
    ordered = dns_targets.in_pod_ordinal_order(
        addresses,
        {
            "10.0.0.3:7": "detlogp-10.detlogp.ns.svc.cluster.local",
            "10.0.0.5:7": "detlogp-2.detlogp.ns.svc.cluster.local",
            "10.0.0.8:7": "detlogp-9.detlogp.ns.svc.cluster.local",
            "[fd00::1]:7": "detlogp-0.detlogp.ns.svc.cluster.local",
        }.get,
    )
    assert ordered == ["[fd00::1]:7", "10.0.0.5:7", "10.0.0.8:7", "10.0.0.3:7"]
    unordered = [
        {"10.0.0.3:7": "detlogp-1.x", "10.0.0.5:7": "detlogp-0.x", "10.0.0.8:7": "detlogp-2.x"},
        dict(zip(addresses, ["detlogp-1.x", "other-0.x", "detlogp-2.x", "detlogp-3.x"])),
        dict(zip(addresses, ["detlogp-1.x", "detlogp.x", "detlogp-2.x", "detlogp-3.x"])),
        dict(zip(addresses, ["detlogp-1.x", "detlogp-1.y", "detlogp-2.x", "detlogp-3.x"])),
        dict(zip(addresses, ["detlogp-1.x", "detlogp-0x2.x", "detlogp-2.x", "-3.x"])),
    ]
    for names in unordered:
        assert dns_targets.in_pod_ordinal_order(addresses, lambda a: names.get(a, "")) == addresses
    assert dns_targets.reverse_name("not an address:1") == ""
    assert dns_targets.resolve_in_pod_order("127.0.0.1", "50051") == ["127.0.0.1:50051"]
    looked_up = dns_targets.reverse_names_within(["not an address:1", "127.0.0.1:7"], budget_s=30)
    assert looked_up == ["", dns_targets.reverse_name("127.0.0.1:7")]
    # A resolver that does not answer in time: no names, and the call
    # returns while its lookup still waits.
    release = threading.Event()

    def slow(address):
        if address == "10.0.0.5:7":
            release.wait()
        return "detlogp-0.x"

    late = dns_targets.reverse_names_within(["10.0.0.3:7", "10.0.0.5:7"], slow, budget_s=0.05)
    release.set()
    assert late == ["", ""]


def test_dns_targets_expand_in_place_and_keep_each_server_once():
    def resolve(host, port):
        return {"pods.test": [f"10.0.0.1:{port}", f"10.0.0.2:{port}"], "empty.test": []}[host]

    expanded = dns_targets.expand_targets(
        ["10.0.0.9:7", "dns:///pods.test:7", "10.0.0.1:7"], resolve
    )
    assert expanded == [
        ("10.0.0.9:7", "", ""),
        ("10.0.0.1:7", "dns:///pods.test:7", "pods.test"),
        ("10.0.0.2:7", "dns:///pods.test:7", "pods.test"),
    ]
    with pytest.raises(detlogp.DetlogpError) as empty:
        dns_targets.expand_targets(["dns:///empty.test:7"], resolve)
    assert empty.value.code == grpc.StatusCode.UNAVAILABLE
    assert "dns:///empty.test:7" in str(empty.value)


@pytest.fixture
def replicas_name(monkeypatch):
    """A fake name, dns:///replicas.test:50051, resolved to the servers that
    the test sets in .addresses (getaddrinfo for every other name)."""
    real = dns_targets.resolve_with_getaddrinfo

    class Name:
        target = "dns:///replicas.test:50051"
        addresses = []

    def resolve(host, port):
        if (host, port) == ("replicas.test", "50051"):
            return sorted(Name.addresses)
        return real(host, port)

    monkeypatch.setattr(dns_targets, "resolve_with_getaddrinfo", resolve)
    return Name


def test_push_to_a_dns_name_stages_and_commits_on_every_address(
    server_binary, model, replicas_name
):
    with (
        start(server_binary, model) as a,
        start(server_binary, model) as b,
        start(server_binary, model) as c,
    ):
        servers = (a, b, c)
        replicas_name.addresses = [s.target for s in servers]
        expected = sorted(replicas_name.addresses)
        version = 1
        pushes = [
            lambda w: _pusher_push(replicas_name.target, w, model, fanout="direct"),
            lambda w: _pusher_push(replicas_name.target, w, model, fanout="chain"),
            lambda w: _client_push(replicas_name.target, w, model),
            lambda w: asyncio.run(_async_client_push(replicas_name.target, w, model)),
        ]
        for seed, push in enumerate(pushes, 70):
            weights = step(model.weight_bits, seed)
            result = push(weights)
            version += 1
            assert result.version == version
            assert sorted(result.per_target) == expected  # each address, named
            assert {s.version for s in result.per_target.values()} == {version}
            digests = {s.weights_sha256 for s in result.per_target.values()}
            assert len(digests) == 1
            for server in servers:
                assert versions_on(server)[version] == (pb.ModelVersionStatus.READY, *digests)
            assert versions_on(a) == versions_on(b) == versions_on(c)
        assert bits_on(a, version, model) == bits_on(c, version, model)

        # A name that resolves to nothing: Unavailable naming it, nothing sent.
        before = versions_on(a)
        with pytest.raises(detlogp.DetlogpError) as nowhere:
            with Pusher([a.target, "dns:///no-such-host.invalid:1"]) as pusher:
                pusher.upload_model("default", step(model.weight_bits, 79), model.bias)
        assert nowhere.value.code == grpc.StatusCode.UNAVAILABLE
        assert "dns:///no-such-host.invalid:1" in str(nowhere.value)
        assert versions_on(a) == before


def _pusher_push(target, weights, model, fanout):
    with Pusher(target, fanout=fanout) as pusher:
        result = pusher.upload_model("default", weights, model.bias)
        assert sorted(pusher.last_sent) == sorted(result.per_target)
        return result


def _client_push(target, weights, model):
    with detlogp.Client(target, timeout=20.0) as client:
        return client.upload_model("default", weights, model.bias, base_version=0)


async def _async_client_push(target, weights, model):
    async with detlogp.aio.AsyncClient(target, timeout=20.0) as client:
        return await client.upload_model("default", weights, model.bias, base_version=0)
