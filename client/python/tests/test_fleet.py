"""Pushing to a fleet from Python (detlogp.fleet.Pusher) against real CPU
servers: deltas against the version pushed last give the bits of a whole
head, a replica without the base gets the whole head, a corrupted delta is
refused with nothing published, and every replica publishes one number.
"""

import detlogp
import grpc
import numpy as np
import pytest
from detlogp import delta, tensors
from detlogp.errors import DataLoss, FailedPrecondition, from_rpc_error
from detlogp.fleet import Pusher
from detlogp.testing import LocalServer, TestModel
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc
from detlogp.weights import LmHead

pytest.importorskip("zstandard")


def step(bits, seed, fraction=0.04):
    """~fraction of the bf16 elements moved by one step (the last bit)."""
    rng = np.random.default_rng(seed)
    moved = rng.random(bits.shape) < fraction
    return bits ^ moved.astype(np.uint16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return TestModel(tmp_path_factory.mktemp("fleet"), hidden=64, vocab=1024, padded_vocab=1024)


def start(server_binary, model, extra=()):
    return LocalServer(server_binary, model.flags + ["--cpu_threads=1", *extra], metrics=True)


def bits_on(server, version, model):
    hidden, targets = model.random_rows(8, seed=3)
    with detlogp.Client(server.target, timeout=20.0) as client:
        result = client.logprobs(hidden, targets, version=version, return_lse=True)
    assert result.model_version == version
    return np.asarray(result.logprobs).view(np.uint32).tolist(), np.asarray(result.lse).view(
        np.uint32
    ).tolist()


def test_delta_codec_round_trips():
    rng = np.random.default_rng(1)
    old = tensors.float32_to_bf16_bits(rng.standard_normal((256, 64)).astype(np.float32))
    new = step(old, 2)
    data = delta.encode_xor_delta(
        [new.view(np.uint8).reshape(-1)], [old.view(np.uint8).reshape(-1)]
    )
    assert len(data) < new.nbytes * 0.1
    assert delta.decode_xor_delta(data, [old.view(np.uint8).reshape(-1)]) == new.tobytes()


def test_delta_push_gives_the_bits_of_a_full_upload(server_binary, model):
    with start(server_binary, model) as by_delta, start(server_binary, model) as by_head:
        second = step(model.weight_bits, 5)
        third = step(second, 6)
        with Pusher([by_delta.target]) as pusher:
            first = pusher.upload_model("default", second, model.bias)  # nothing pushed before
            assert pusher.last_sent[by_delta.target][0] == "head"
            pushed = pusher.upload_model("default", third, model.bias)  # against `first`
            kind, sent = pusher.last_sent[by_delta.target]
            assert kind == "delta"
            assert sent <= 0.06 * LmHead(third, model.bias).nbytes
        with Pusher([by_head.target]) as pusher:
            pusher.upload_model("default", second, model.bias)
            full = pusher.upload_model("default", third, model.bias, base_version=0)
            assert pusher.last_sent[by_head.target][0] == "head"
        assert (first.version, pushed.version) == (2, 3)
        assert pushed.weights_sha256 == full.weights_sha256 == LmHead(third, model.bias).sha256()
        assert pushed.determinism_key == full.determinism_key
        assert bits_on(by_delta, 3, model) == bits_on(by_head, 3, model)
        samples = by_delta.metrics()
        head_bytes = LmHead(second, model.bias).nbytes
        assert samples['detlogp_model_bytes_received_total{from="pusher"}'] == head_bytes + sent
        assert samples['detlogp_model_bytes_received_total{from="peer"}'] == 0


def test_delta_of_cuda_tensors_equals_the_host_delta(server_binary, model):
    """CUDA tensors: the pusher forms the XOR on the GPU; what it sends and
    what the replica publishes equal the numpy path's, bit for bit."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    second = step(model.weight_bits, 11)
    third = step(second, 12)

    def on_gpu(bits):
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).cuda()

    with start(server_binary, model) as from_gpu, start(server_binary, model) as from_host:
        with Pusher([from_gpu.target]) as pusher:
            pusher.upload_model("default", on_gpu(second), model.bias)
            gpu = pusher.upload_model("default", on_gpu(third), model.bias)
            gpu_sent = pusher.last_sent[from_gpu.target]
        with Pusher([from_host.target]) as pusher:
            pusher.upload_model("default", second, model.bias)
            host = pusher.upload_model("default", third, model.bias)
            host_sent = pusher.last_sent[from_host.target]
        assert gpu_sent[0] == host_sent[0] == "delta"
        assert gpu_sent[1] <= 0.06 * LmHead(third, model.bias).nbytes
        assert gpu.weights_sha256 == host.weights_sha256 == LmHead(third, model.bias).sha256()
        assert bits_on(from_gpu, 3, model) == bits_on(from_host, 3, model)


def test_missing_base_falls_back_to_the_head(server_binary, model, tmp_path):
    other = TestModel(tmp_path, hidden=64, vocab=1024, padded_vocab=1024, seed=99)
    with start(server_binary, model) as with_base, start(server_binary, other) as without:
        new = step(model.weight_bits, 7)
        head = LmHead(new, model.bias)
        lm_delta = head.delta_against(LmHead(model.weight_bits, model.bias), 1)
        with pytest.raises(FailedPrecondition) as refused:
            upload(without.target, head.delta_messages("default", lm_delta))
        assert refused.value.reason == "BASE_MISSING"
        with Pusher([with_base.target, without.target]) as pusher:
            result = pusher.upload_model(
                "default",
                new,
                model.bias,
                base_version=1,
                base_weights=(model.weight_bits, model.bias),
            )
            assert pusher.last_sent[with_base.target][0] == "delta"
            assert pusher.last_sent[without.target][0] == "head"
        assert result.version == 2
        assert bits_on(with_base, 2, model) == bits_on(without, 2, model)


def test_corrupted_delta_is_refused_and_nothing_published(server_binary, model):
    with start(server_binary, model) as server:
        head = LmHead(step(model.weight_bits, 8), model.bias)
        lm_delta = head.delta_against(LmHead(model.weight_bits, model.bias), 1)
        data = bytearray(lm_delta.data)
        data[len(data) // 2] ^= 0x5A
        corrupted = type(lm_delta)(
            lm_delta.base_version,
            lm_delta.base_weights_sha256,
            lm_delta.weights_sha256,
            bytes(data),
        )
        with pytest.raises(DataLoss):
            upload(server.target, head.delta_messages("default", corrupted))
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.ModelRepositoryServiceStub(channel)
            models = stub.ListModels(pb.ListModelsRequest(), timeout=20)
        assert [m.model_version for m in models.models] == [1]


def test_every_replica_publishes_one_number(server_binary, model):
    with (
        start(server_binary, model) as a,
        start(server_binary, model) as b,
        start(server_binary, model) as c,
    ):
        with Pusher([b.target]) as ahead:  # b two versions ahead
            ahead.upload_model("default", step(model.weight_bits, 11), model.bias)
            ahead.upload_model("default", step(model.weight_bits, 12), model.bias)
        with Pusher([a.target, b.target, c.target]) as pusher:
            assert pusher.fleet_version("default") == 4
            result = pusher.upload_model("default", step(model.weight_bits, 13), model.bias)
        assert result.version == 4
        assert {s.version for s in result.per_target.values()} == {4}


def upload(target, messages):
    """One raw UploadModel call; a refusal raised as the client's typed error."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ModelRepositoryServiceStub(channel)
        try:
            return stub.UploadModel(messages, timeout=20)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None


def test_chain_push_reaches_every_replica_from_one_upload(server_binary, model):
    with (
        start(server_binary, model) as a,
        start(server_binary, model) as b,
        start(server_binary, model) as c,
    ):
        targets = [a.target, b.target, c.target]
        new = step(model.weight_bits, 21)
        with Pusher(targets, fanout="chain") as pusher:
            result = pusher.upload_model("default", new, model.bias)
            assert [pusher.last_sent[t][0] for t in targets] == ["head", "chain", "chain"]
            # The next step as a delta, down the same chain.
            again = pusher.upload_model("default", step(new, 22), model.bias)
            assert [pusher.last_sent[t][0] for t in targets] == ["delta", "chain", "chain"]
        assert (result.version, again.version) == (2, 3)
        head_bytes = LmHead(new, model.bias).nbytes
        peer = 'detlogp_model_bytes_received_total{from="peer"}'
        pusher_bytes = 'detlogp_model_bytes_received_total{from="pusher"}'
        assert a.metrics()[peer] == 0 and a.metrics()[pusher_bytes] > head_bytes
        for server in (b, c):
            assert server.metrics()[pusher_bytes] == 0
            assert server.metrics()[peer] == a.metrics()[pusher_bytes]
        assert bits_on(a, 3, model) == bits_on(c, 3, model)


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


def test_client_upload_model_commits_everywhere_and_sends_deltas(server_binary, model):
    with start(server_binary, model) as a, start(server_binary, model) as b:
        second = step(model.weight_bits, 41)
        third = step(second, 42)
        head_bytes = LmHead(second, model.bias).nbytes
        with detlogp.Client([a.target, b.target], timeout=20.0) as client:
            first = client.upload_model("default", second, model.bias)
            pushed = client.upload_model("default", third, model.bias)  # a delta against `first`
            full = client.upload_model("default", step(third, 43), model.bias, base_version=0)
            named = client.upload_model(
                "default",
                step(third, 44),
                model.bias,
                base_version=full.version,
                base_weights=(step(third, 43), model.bias),
            )
        assert (first.version, pushed.version, full.version, named.version) == (2, 3, 4, 5)
        for result in (first, pushed, full, named):
            ready = [s.ready_unix_micros for s in result.per_target.values()]
            assert min(ready) > 0
            assert {s.state for s in result.per_target.values()} == {pb.ModelVersionStatus.READY}
        assert pushed.weights_sha256 == LmHead(third, model.bias).sha256()
        sent = a.metrics()['detlogp_model_bytes_received_total{from="pusher"}']
        # Two heads, two deltas of ~4% each.
        assert 2 * head_bytes < sent <= 2 * head_bytes + 2 * 0.06 * head_bytes
        assert versions_on(a) == versions_on(b)
        assert bits_on(a, 5, model) == bits_on(b, 5, model)
