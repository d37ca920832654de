"""Live weights from the Python clients against the real CPU server: named
models, numbered versions, uploads and loads swapped under load, pinned
versions, replicas, admin tokens, the model root's bounds.

Every model is small (H=64, V=1000 padded to 1024). Bits are compared with
a fresh server started with the same weights through --weights: an upload
must serve exactly what a start-up load serves.
"""

import asyncio
import concurrent.futures
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import detlogp
import detlogp.requests
import grpc
import numpy as np
import pytest
from detlogp import safetensors_io
from detlogp import weights as lm_weights
from detlogp.aio import AsyncClient
from detlogp.credentials import bearer
from detlogp.errors import from_rpc_error
from detlogp.testing import LocalServer, TestModel
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

ROWS = 8


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("live")


@pytest.fixture(scope="module")
def trained(folder):
    """The weights a trainer pushes (seed 11)."""
    return TestModel(folder, seed=11)


@pytest.fixture(scope="module")
def third(folder):
    return TestModel(folder, seed=12)


@pytest.fixture(scope="module")
def ref_model(folder):
    return TestModel(folder, seed=31)


@pytest.fixture(scope="module")
def root(folder):
    path = folder / "root"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def live(server_binary, model, ref_model, root):
    """`model` (seed 7) as "default" version 1, `ref_model` as "reference",
    a model root, and room for 8 versions per model."""
    with LocalServer(
        server_binary,
        model.flags
        + [
            f"--model=reference={ref_model.path}",
            f"--model_root={root}",
            "--max_versions_per_model=8",
            "--cpu_threads=1",
        ],
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def fresh(server_binary, trained):
    """A server started with `trained` through --weights."""
    with LocalServer(server_binary, trained.flags + ["--cpu_threads=1"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def replica(server_binary, model):
    """A second replica, started like `live` but without its other models."""
    with LocalServer(server_binary, model.flags + ["--cpu_threads=1"]) as srv:
        yield srv


@pytest.fixture
def client(live):
    with detlogp.Client(live.target, timeout=20.0) as c:
        yield c


def _rows(test_model, seed, n=ROWS):
    return test_model.random_rows(n, seed=seed)


def _answer(target, hidden, targets, **kwargs):
    with detlogp.Client(target, timeout=20.0) as c:
        return c.logprobs(hidden, targets, return_lse=True, **kwargs)


def _upload(client, name, test_model, **kwargs):
    return client.upload_model(
        name, test_model.weight_bits, test_model.bias, vocab_size=test_model.vocab, **kwargs
    )


def _versions(client, name):
    return [v.version for v in client.info(model=name).versions]


def _raw_upload(target, messages, token=None):
    """UploadModel with hand-made messages; the typed error or the status."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ModelRepositoryServiceStub(channel)
        try:
            return stub.UploadModel(
                iter(messages), timeout=20, metadata=bearer(token) if token else None
            )
        except grpc.RpcError as error:
            return from_rpc_error(error)


# ---------------------------------------------------------------- versions
def test_upload_becomes_latest_with_the_bits_of_a_fresh_server(client, fresh, trained, model):
    hidden, targets = _rows(model, seed=1)
    before = client.logprobs(hidden, targets, return_lse=True)
    assert (before.model, before.model_version) == ("default", 1)

    published = _upload(client, "default", trained)
    fresh_info = detlogp.Client(fresh.target).info()
    assert published.version == 2
    assert (
        published.weights_sha256
        == fresh_info.weights_sha256
        == detlogp.lm_head_sha256(trained.weight_bits, trained.bias, trained.vocab)
    )
    assert published.determinism_key == fresh_info.determinism_key
    assert published.status.source == "upload" and published.status.persisted

    after = client.logprobs(hidden, targets, return_lse=True)
    want = _answer(fresh.target, hidden, targets)
    assert (after.model, after.model_version) == ("default", 2)
    assert after.logprobs.tobytes() == want.logprobs.tobytes()
    assert after.lse.tobytes() == want.lse.tobytes()
    assert after.determinism_key == want.determinism_key != before.determinism_key
    info = client.info()
    assert info.model_version == 2 and [v.version for v in info.versions] == [1, 2]
    assert client.info(version=1).weights_sha256 != info.weights_sha256

    pinned = client.logprobs(hidden, targets, return_lse=True, version=1)
    assert pinned.model_version == 1
    assert pinned.logprobs.tobytes() == before.logprobs.tobytes()


def test_pinned_version_keeps_its_bits_while_versions_swap(
    client, server, model, trained, third, fresh
):
    """Readers pinned to version 1 and readers of the latest version run
    while versions 2 and 3 are uploaded; every answer's bits are the bits of
    the version it names."""
    hidden, targets = _rows(model, seed=2)
    v1 = _upload(client, "swap", model)
    assert v1.version == 1
    # An upload of the start-up weights serves the start-up bits.
    want_v1 = _answer(server.target, hidden, targets)
    assert (
        client.logprobs(hidden, targets, model="swap").logprobs.tobytes()
        == want_v1.logprobs.tobytes()
    )

    stop = threading.Event()
    pinned, latest = [], []

    def read(out, **kwargs):
        with detlogp.Client(client.targets, timeout=20.0) as reader:
            while not stop.is_set():
                out.append(reader.logprobs(hidden, targets, model="swap", **kwargs))

    readers = [
        threading.Thread(target=read, args=(pinned,), kwargs={"version": 1}),
        threading.Thread(target=read, args=(pinned,), kwargs={"version": 1}),
        threading.Thread(target=read, args=(latest,)),
    ]
    for thread in readers:
        thread.start()
    try:
        assert _upload(client, "swap", trained).version == 2
        assert _upload(client, "swap", third).version == 3
        # The reader's second answer from now on was asked after the swap.
        seen = len(latest)
        while len(latest) < seen + 2:
            threading.Event().wait(0.005)
    finally:
        stop.set()
        for thread in readers:
            thread.join()

    assert pinned and all(r.model_version == 1 for r in pinned)
    assert {r.logprobs.tobytes() for r in pinned} == {want_v1.logprobs.tobytes()}
    want = {
        1: want_v1.logprobs.tobytes(),
        2: _answer(fresh.target, hidden, targets).logprobs.tobytes(),
        3: client.logprobs(hidden, targets, model="swap", version=3).logprobs.tobytes(),
    }
    assert len(set(want.values())) == 3
    for answer in latest:
        assert answer.logprobs.tobytes() == want[answer.model_version], answer.model_version
    assert latest[-1].model_version == 3
    print(
        f"{len(pinned)} pinned and {len(latest)} latest answers during two swaps; "
        f"latest saw versions {sorted({r.model_version for r in latest})}"
    )


def test_reference_and_policy_side_by_side(client, ref_model, trained, fresh):
    policy = _upload(client, "policy", trained)
    ref_copy = _upload(client, "ref-copy", ref_model)
    hidden, targets = _rows(ref_model, seed=3)
    ref = client.logprobs(hidden, targets, model="reference")
    pol = client.logprobs(hidden, targets, model="policy", version=policy.version)
    assert (ref.model, pol.model) == ("reference", "policy")
    assert ref.logprobs.tobytes() != pol.logprobs.tobytes()
    assert ref.determinism_key != pol.determinism_key
    # The start-up reference and an upload of the same weights agree bitwise.
    assert (
        client.logprobs(hidden, targets, model="ref-copy").logprobs.tobytes()
        == ref.logprobs.tobytes()
    )
    assert ref_copy.determinism_key == client.info(model="reference").determinism_key
    assert pol.logprobs.tobytes() == _answer(fresh.target, hidden, targets).logprobs.tobytes()
    want_ref, _ = ref_model.reference(hidden, targets)
    np.testing.assert_allclose(ref.logprobs, want_ref, rtol=0, atol=2e-4)

    # Interleaved from many threads: each answer is its model's.
    def one(i):
        name = ("reference", "policy")[i % 2]
        return name, client.logprobs(hidden, targets, model=name)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for name, answer in pool.map(one, range(40)):
            assert answer.model == name
            want = ref if name == "reference" else pol
            assert answer.logprobs.tobytes() == want.logprobs.tobytes()

    # Streams: a default model for the items that name none.
    raw = detlogp.requests.logprob_request(hidden, targets)
    streamed = list(
        client.stream(
            [(hidden, targets), {"hidden": hidden, "targets": targets, "model": "reference"}, raw],
            model="policy",
            version=policy.version,
        )
    )
    assert [(r.model, r.model_version) for r in streamed] == [
        ("policy", policy.version),
        ("reference", 1),
        ("policy", policy.version),
    ]
    assert streamed[1].logprobs.tobytes() == ref.logprobs.tobytes()
    assert streamed[2].logprobs.tobytes() == pol.logprobs.tobytes()
    assert raw.model == "" and raw.model_version == 0  # the caller's message is untouched

    assert client.info("reference").model == "reference"
    assert client.info(10.0).model == "default"  # a number is the former timeout
    listing = client.list_models()
    names = [m.model for m in listing.models]
    assert names == sorted(names) and {"default", "reference", "policy"} <= set(names)
    assert listing.default_model == "default"


def test_the_default_models_only_version_cannot_be_unloaded(server_binary, model):
    """Requests without a model would all fail while health says SERVING."""
    with LocalServer(server_binary, model.flags + ["--cpu_threads=1"]) as srv:
        with detlogp.Client(srv.target) as c:
            with pytest.raises(detlogp.FailedPrecondition) as error:
                c.unload_model("default", 1)
            assert error.value.field == "model_version"
            hidden, targets = _rows(model, seed=5, n=2)
            assert c.logprobs(hidden, targets).model_version == 1
            assert c.health() == "SERVING"


def test_unknown_model_and_version_are_not_found(client, model):
    hidden, targets = _rows(model, seed=4, n=2)
    with pytest.raises(detlogp.NotFound) as error:
        client.logprobs(hidden, targets, model="no-such-model")
    assert error.value.field == "model" and "no-such-model" in error.value.details
    with pytest.raises(detlogp.NotFound) as error:
        client.logprobs(hidden, targets, model="reference", version=99)
    assert error.value.field == "model_version"
    with pytest.raises(detlogp.NotFound):
        client.info(model="no-such-model")
    with pytest.raises(detlogp.NotFound) as error:
        client.info(model="reference", version=99)
    assert error.value.field == "model_version"
    with pytest.raises(detlogp.NotFound):
        list(client.stream([(hidden, targets)], model="reference", version=99))
    with pytest.raises(detlogp.NotFound):
        client.unload_model("no-such-model", 1)
    with pytest.raises(detlogp.NotFound):
        client.unload_model("reference", 99)
    assert client.retries == 0  # one target: nothing to move on to


@pytest.mark.parametrize("dtype,name", [(np.float32, "F32"), (np.float16, "F16")])
def test_float_uploads_round_to_bf16_as_the_server_rounds_a_float_file(
    client, server_binary, folder, dtype, name
):
    """Unrounded weights (with exact ties) uploaded from numpy serve the same
    digest and bits as the same weights in a file the server rounds itself."""
    rng = np.random.default_rng(14)
    weight = (rng.standard_normal((1024, 64)) * 0.5).astype(np.float32)
    ties = rng.random(weight.shape) < 0.25
    bits = weight.view(np.uint32)
    bits[ties] = (bits[ties] & 0xFFFF0000) | 0x8000  # halfway between two bf16
    weight = weight.astype(dtype)
    bias = rng.standard_normal(1024).astype(np.float32)
    path = folder / f"unrounded_{name}.safetensors"
    safetensors_io.write(path, {"lm_head.weight": weight, "lm_head.bias": bias})
    with LocalServer(
        server_binary,
        [f"--weights={path}", "--bias_tensor=lm_head.bias", "--vocab_size=1000", "--cpu_threads=1"],
    ) as own:
        hidden = rng.standard_normal((ROWS, 64)).astype(np.float32)
        targets = rng.integers(0, 1000, size=ROWS)
        want = _answer(own.target, hidden, targets)
        own_info = detlogp.Client(own.target).info()
    published = client.upload_model(f"unrounded-{name}", weight, bias, vocab_size=1000)
    assert published.weights_sha256 == own_info.weights_sha256
    assert published.determinism_key == want.determinism_key
    got = client.logprobs(hidden, targets, model=f"unrounded-{name}", return_lse=True)
    assert got.logprobs.tobytes() == want.logprobs.tobytes()
    assert got.lse.tobytes() == want.lse.tobytes()


# ---------------------------------------------------------------- refusals
def test_tampered_upload_is_data_loss_and_changes_nothing(client, live, root, trained, third):
    hidden, targets = _rows(trained, seed=5)
    _upload(client, "tamper", trained)
    before = client.logprobs(hidden, targets, model="tamper")

    # A byte flipped in flight: the digest (of the right bytes) no longer matches.
    messages = list(
        lm_weights.LmHead(trained.weight_bits, trained.bias, trained.vocab).messages(
            "tamper", chunk_bytes=16 << 10
        )
    )
    assert len(messages) > 4
    flipped = bytearray(messages[2].chunk)
    flipped[100] ^= 0x01
    messages[2] = pb.UploadModelRequest(chunk=bytes(flipped))
    error = _raw_upload(live.target, messages)
    assert isinstance(error, detlogp.DataLoss), error
    assert error.field == "weights_sha256"

    # Other weights claiming the first weights' digest.
    with pytest.raises(detlogp.DataLoss):
        _upload(
            client,
            "tamper",
            third,
            weights_sha256=detlogp.lm_head_sha256(trained.weight_bits, trained.bias, trained.vocab),
        )

    assert _versions(client, "tamper") == [1]
    assert (
        client.logprobs(hidden, targets, model="tamper").logprobs.tobytes()
        == before.logprobs.tobytes()
    )
    assert sorted(os.listdir(root / "tamper")) == ["1"]  # no temporaries left
    # The next good upload is version 2: refused uploads took no number.
    assert _upload(client, "tamper", third).version == 2


def test_bad_upload_header_is_invalid_argument_naming_the_field(client, live, trained):
    bias = trained.bias
    with pytest.raises(detlogp.InvalidArgument) as error:  # H not a multiple of 8
        client.upload_model("bad", trained.weight_bits[:, :60], bias)
    assert error.value.field == "header.shape"
    with pytest.raises(detlogp.InvalidArgument) as error:
        client.upload_model("bad", trained.weight_bits, bias, vocab_size=2000)
    assert error.value.field == "header.vocab_size"
    with pytest.raises(detlogp.InvalidArgument) as error:
        client.upload_model("bad/name", trained.weight_bits, bias)
    assert error.value.field == "header.model"

    # A header announcing more bytes than sent: the chunks are short.
    messages = list(
        lm_weights.LmHead(trained.weight_bits, bias, trained.vocab).messages(
            "bad", chunk_bytes=64 << 10
        )
    )
    error = _raw_upload(live.target, messages[:2] + messages[-1:])
    assert isinstance(error, detlogp.InvalidArgument) and error.field == "chunk", error
    # The digest as a message of its own before the chunks (it must be last).
    header = pb.UploadModelRequest()
    header.CopyFrom(messages[0])
    digest = header.header.weights_sha256
    header.header.weights_sha256 = ""
    error = _raw_upload(
        live.target, [header, pb.UploadModelRequest(weights_sha256=digest)] + messages[1:]
    )
    assert isinstance(error, detlogp.InvalidArgument), error
    assert error.field == "weights_sha256"

    # Caught before sending.
    with pytest.raises(ValueError, match="bias"):
        client.upload_model("bad", trained.weight_bits, bias[:10])
    with pytest.raises(ValueError, match="padded_vocab_size, hidden_size"):
        client.upload_model("bad", trained.weight_bits.reshape(-1))
    with pytest.raises(TypeError):
        client.upload_model("bad", trained.weight_bits.astype(np.int32))
    with pytest.raises(detlogp.NotFound):
        client.info(model="bad")  # nothing was created


def test_upload_over_the_memory_bound_is_refused_and_changes_nothing(server_binary, model, folder):
    big = TestModel(folder, seed=41, vocab=4000, padded_vocab=4096)
    with (
        LocalServer(
            server_binary, model.flags + ["--max_model_memory_bytes=300000", "--cpu_threads=1"]
        ) as srv,
        detlogp.Client(srv.target, timeout=20.0) as client,
    ):
        hidden, targets = _rows(model, seed=6)
        before = client.logprobs(hidden, targets)
        used = sum(v.memory_bytes for v in client.info().versions)
        # Another shape, so another model (a version keeps its model's shape).
        with pytest.raises(detlogp.Overloaded) as error:
            _upload(client, "big", big)
        assert not error.value.queue_full and client.retries == 0
        print(f"refused: {error.value.details}")
        info = client.info()
        assert [v.version for v in info.versions] == [1]
        assert sum(v.memory_bytes for v in info.versions) == used
        after = client.logprobs(hidden, targets)
        assert (after.model_version, after.logprobs.tobytes()) == (1, before.logprobs.tobytes())
        # Weights that fit are taken.
        assert _upload(client, "default", model).version == 2


# ---------------------------------------------------------------- admin
@pytest.fixture(scope="module")
def guarded(server_binary, model, folder):
    (folder / "score_tokens").write_text("score-token\n")
    (folder / "admin_tokens").write_text("# admins\nadmin-token\n")
    with LocalServer(
        server_binary,
        model.flags
        + [
            f"--auth_tokens_file={folder / 'score_tokens'}",
            f"--admin_tokens_file={folder / 'admin_tokens'}",
            "--cpu_threads=1",
        ],
    ) as srv:
        yield srv


@pytest.mark.parametrize(
    "token,admin_token",
    [(None, None), ("score-token", None), ("score-token", "wrong"), (None, "score-token")],
)
def test_admin_calls_need_an_admin_token(guarded, trained, token, admin_token):
    with detlogp.Client(
        guarded.target, token=token, admin_token=admin_token, timeout=10.0, retry=detlogp.NO_RETRY
    ) as client:
        with pytest.raises(detlogp.Unauthenticated) as error:
            client.list_models()
        assert "admin" in error.value.details
        with pytest.raises(detlogp.Unauthenticated):
            _upload(client, "default", trained)
        with pytest.raises(detlogp.Unauthenticated):
            client.unload_model("default", 1)


def test_admin_token_is_sent_on_admin_calls_only(guarded, trained, model):
    hidden, targets = _rows(model, seed=7, n=2)
    with detlogp.Client(
        guarded.target, token="score-token", admin_token="admin-token", timeout=10.0
    ) as client:
        assert [m.model for m in client.list_models().models] == ["default"]
        published = _upload(client, "guarded", trained)
        answer = client.logprobs(hidden, targets, model="guarded", version=published.version)
        assert answer.model_version == published.version
    # The admin token is no scoring token.
    with detlogp.Client(
        guarded.target, token="admin-token", timeout=10.0, retry=detlogp.NO_RETRY
    ) as client:
        with pytest.raises(detlogp.Unauthenticated):
            client.logprobs(hidden, targets)

    async def run():
        async with AsyncClient(
            guarded.target, token="score-token", admin_token="admin-token", timeout=10.0
        ) as aclient:
            published = await aclient.upload_model(
                "guarded-aio", trained.weight_bits, trained.bias, trained.vocab
            )
            answer = await aclient.logprobs(hidden, targets, model="guarded-aio")
        async with AsyncClient(guarded.target, token="score-token", timeout=10.0) as aclient:
            with pytest.raises(detlogp.Unauthenticated):
                await aclient.upload_model("guarded-aio", trained.weight_bits, trained.bias)
        return published, answer

    published, answer = asyncio.run(run())
    assert (answer.model, answer.model_version) == ("guarded-aio", published.version)


def test_async_refused_uploads_report_the_servers_status(guarded, folder):
    """The server ends a refused upload before the client has written every
    chunk; the asyncio client must still report the server's status (grpcio's
    asyncio calls turn it into INTERNAL when a write loses that race). 2 MiB
    of weights in 1 KiB chunks: most writes come after the refusal."""
    trained = TestModel(folder, hidden=256, vocab=4000, padded_vocab=4096, seed=13)

    async def run():
        refusals = []
        async with AsyncClient(
            guarded.target,
            token="score-token",
            admin_token="wrong",
            timeout=10.0,
            retry=detlogp.NO_RETRY,
        ) as aclient:
            for _ in range(12):
                try:
                    await aclient.upload_model(
                        "refused-aio",
                        trained.weight_bits,
                        trained.bias,
                        trained.vocab,
                        chunk_bytes=1024,
                    )
                except detlogp.DetlogpError as error:
                    refusals.append(error)
        async with AsyncClient(
            guarded.target,
            token="score-token",
            admin_token="admin-token",
            timeout=10.0,
            retry=detlogp.NO_RETRY,
        ) as aclient:
            first = await aclient.upload_model(
                "taken-aio", trained.weight_bits, trained.bias, trained.vocab, version=5
            )
            for _ in range(12):
                try:
                    await aclient.upload_model(
                        "taken-aio",
                        trained.weight_bits,
                        trained.bias,
                        trained.vocab,
                        chunk_bytes=1024,
                        version=5,
                    )
                except detlogp.DetlogpError as error:
                    refusals.append(error)
        return first, refusals

    first, refusals = asyncio.run(run())
    assert first.version == 5
    assert [type(e) for e in refusals] == [detlogp.Unauthenticated] * 12 + [
        detlogp.FailedPrecondition
    ] * 12
    assert all(e.field == "header.model_version" for e in refusals[12:])


# ---------------------------------------------------------------- model root
def test_load_model_stays_inside_the_model_root(client, server, root, folder, trained, fresh):
    (root / "incoming").mkdir(exist_ok=True)
    shutil.copy(trained.path, root / "incoming" / "lm.safetensors")
    digest = detlogp.lm_head_sha256(trained.weight_bits, trained.bias, trained.vocab)
    loaded = client.load_model(
        "loaded",
        "incoming/lm.safetensors",
        bias_tensor="lm_head.bias",
        vocab_size=trained.vocab,
        expected_sha256=digest,
    )
    assert loaded.version == 1 and loaded.weights_sha256 == digest
    assert loaded.status.source == "load:incoming/lm.safetensors"
    hidden, targets = _rows(trained, seed=8)
    assert (
        client.logprobs(hidden, targets, model="loaded").logprobs.tobytes()
        == _answer(fresh.target, hidden, targets).logprobs.tobytes()
    )

    outside = folder / "outside.safetensors"
    shutil.copy(trained.path, outside)
    os.symlink(outside, root / "incoming" / "escape.safetensors")
    os.symlink(folder, root / "incoming" / "up")
    for path, why in [
        (str(outside), "absolute"),
        ("incoming/../incoming/lm.safetensors", ".."),
        ("../outside.safetensors", ".."),
        ("incoming/escape.safetensors", "symlink"),
        ("incoming/up/outside.safetensors", "symlink"),
    ]:
        with pytest.raises(detlogp.PermissionDenied) as error:
            client.load_model("loaded", path, bias_tensor="lm_head.bias")
        assert error.value.field == "path" and why in error.value.details, error.value
    with pytest.raises(detlogp.NotFound) as error:
        client.load_model("loaded", "incoming/missing.safetensors")
    assert error.value.field == "path"
    with pytest.raises(detlogp.InvalidArgument) as error:
        client.load_model(
            "loaded",
            "incoming/lm.safetensors",
            bias_tensor="lm_head.bias",
            vocab_size=trained.vocab,
            expected_sha256="0" * 64,
        )
    assert error.value.field == "expected_weights_sha256"
    assert _versions(client, "loaded") == [1]

    # A server without --model_root loads nothing.
    with detlogp.Client(server.target, timeout=10.0) as plain:
        with pytest.raises(detlogp.FailedPrecondition):
            plain.load_model("loaded", "incoming/lm.safetensors")


# ---------------------------------------------------------------- clients
def test_torch_tensors_upload_like_numpy(client, trained):
    torch = pytest.importorskip("torch")
    numpy_upload = lm_weights.LmHead(trained.weight_bits, trained.bias, trained.vocab)
    bf16 = torch.from_numpy(trained.weight_bits.view(np.int16)).view(torch.bfloat16)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        tensor = bf16.to(device)
        bias = torch.from_numpy(trained.bias).to(device)
        head = lm_weights.LmHead(tensor, bias, trained.vocab)
        assert head.weight.tobytes() == numpy_upload.weight.tobytes()
        assert head.sha256() == numpy_upload.sha256()
        # float32 and float16 tensors round like numpy's (the server's RNE).
        wide = np.random.default_rng(9).standard_normal((256, 64)).astype(np.float32)
        for dtype in (np.float32, np.float16):
            want = lm_weights.LmHead(wide.astype(dtype)).weight
            got = lm_weights.LmHead(torch.from_numpy(wide.astype(dtype)).to(device)).weight
            assert got.tobytes() == want.tobytes()
        published = client.upload_model(f"torch-{device}", tensor, bias, trained.vocab)
        assert published.weights_sha256 == numpy_upload.sha256()


def test_async_client_uploads_and_scores(live, fresh, trained):
    hidden, targets = _rows(trained, seed=10)
    want = _answer(fresh.target, hidden, targets)

    async def run():
        async with AsyncClient(live.target, timeout=20.0) as aclient:
            published = await aclient.upload_model(
                "aio", trained.weight_bits, trained.bias, trained.vocab, chunk_bytes=32 << 10
            )
            answers = await asyncio.gather(
                *[
                    aclient.logprobs(hidden, targets, model="aio", version=published.version)
                    for _ in range(8)
                ]
            )
            streamed = [r async for r in aclient.stream([(hidden, targets)] * 3, model="aio")]
            info = await aclient.info(model="aio")
            listing = await aclient.list_models()
            await aclient.unload_model("aio", published.version)
            with pytest.raises(detlogp.NotFound):
                await aclient.logprobs(hidden, targets, model="aio", version=published.version)
            return published, answers + streamed, info, listing

    published, answers, info, listing = asyncio.run(run())
    assert published.version == 1 and info.model_version == 1
    assert published.determinism_key == want.determinism_key
    assert "aio" in [m.model for m in listing.models]
    for answer in answers:
        assert (answer.model, answer.model_version) == ("aio", 1)
        assert answer.logprobs.tobytes() == want.logprobs.tobytes()


def test_upload_to_two_targets_gives_equal_keys(live, replica, trained, fresh):
    hidden, targets = _rows(trained, seed=11)
    with detlogp.Client([live.target, replica.target], timeout=20.0) as both:
        published = _upload(both, "multi", trained)
        assert set(published.per_target) == {live.target, replica.target}
        keys = {s.determinism_key for s in published.per_target.values()}
        assert keys == {published.determinism_key}
        assert published.version == 1
        answers = [both.logprobs(hidden, targets, model="multi") for _ in range(4)]
    want = _answer(fresh.target, hidden, targets)
    assert {a.logprobs.tobytes() for a in answers} == {want.logprobs.tobytes()}
    assert {a.determinism_key for a in answers} == {want.determinism_key}


def test_pinned_version_moves_past_a_replica_without_it(live, replica, trained, third):
    hidden, targets = _rows(trained, seed=12)
    with (
        detlogp.Client([live.target, replica.target], timeout=20.0) as both,
        detlogp.Client(live.target, timeout=20.0) as only_live,
    ):
        assert _upload(both, "lagging", trained).version == 1
        v2 = _upload(only_live, "lagging", third)  # the replica misses version 2
        assert v2.version == 2
        want = only_live.logprobs(hidden, targets, model="lagging", version=2)
        answers = [both.logprobs(hidden, targets, model="lagging", version=2) for _ in range(6)]
        assert all(a.model_version == 2 for a in answers)
        assert {a.logprobs.tobytes() for a in answers} == {want.logprobs.tobytes()}
        assert both.retries == 3  # every call that went to the replica first
        print(f"6 calls pinned to v2 over [live, replica]: {both.retries} moved on")

        attempts = both.attempts
        with pytest.raises(detlogp.NotFound):
            both.logprobs(hidden, targets, model="lagging", version=3)
        assert both.attempts - attempts == 2  # bounded by the targets
        with pytest.raises(detlogp.NotFound):
            both.info(model="lagging", version=3)

        # The replicas now hold different numbers: a multi-target upload
        # numbers the push one above the highest either has, on both.
        realigned = _upload(both, "lagging", trained)
        assert {s.version for s in realigned.per_target.values()} == {3}
        # A version number named by the trainer realigns them.
        aligned = _upload(both, "lagging", third, version=10)
        assert {s.version for s in aligned.per_target.values()} == {10}
        retries = both.retries
        answers = [both.logprobs(hidden, targets, model="lagging", version=10) for _ in range(4)]
        assert {a.logprobs.tobytes() for a in answers} == {want.logprobs.tobytes()}
        assert both.retries == retries  # both targets hold it


def test_explicit_version_numbers_must_increase(client, root, trained, third):
    hidden, targets = _rows(trained, seed=15)
    assert _upload(client, "numbered", trained, version=5).version == 5
    before = client.logprobs(hidden, targets, model="numbered")
    for taken in (5, 3):
        with pytest.raises(detlogp.FailedPrecondition) as error:
            _upload(client, "numbered", third, version=taken)
        assert error.value.field == "header.model_version", error.value
    with pytest.raises(detlogp.InvalidArgument) as error:
        _upload(client, "numbered", third, version=-1)
    assert error.value.field == "header.model_version"
    assert _versions(client, "numbered") == [5]
    after = client.logprobs(hidden, targets, model="numbered")
    assert (after.model_version, after.logprobs.tobytes()) == (5, before.logprobs.tobytes())
    assert _upload(client, "numbered", third).version == 6  # the next after 5

    (root / "numbered-files").mkdir()
    shutil.copy(trained.path, root / "numbered-files" / "lm.safetensors")
    with pytest.raises(detlogp.FailedPrecondition) as error:
        client.load_model(
            "numbered",
            "numbered-files/lm.safetensors",
            bias_tensor="lm_head.bias",
            vocab_size=trained.vocab,
            version=6,
        )
    assert error.value.field == "model_version"
    loaded = client.load_model(
        "numbered",
        "numbered-files/lm.safetensors",
        bias_tensor="lm_head.bias",
        vocab_size=trained.vocab,
        version=9,
    )
    assert loaded.version == 9 and _versions(client, "numbered") == [5, 6, 9]
    pinned = client.logprobs(hidden, targets, model="numbered", version=5)
    assert pinned.logprobs.tobytes() == before.logprobs.tobytes()


# ---------------------------------------------------------------- CLI
def _cli(target, *args):
    script = pathlib.Path(sys.executable).with_name("detlogp")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "detlogp.cli"]
    return subprocess.run(
        command + ["--target", target, *args], capture_output=True, text=True, timeout=60
    )


def test_cli_models_upload_load_score_unload(live, root, trained, third, tmp_path):
    run = lambda *args: _cli(live.target, *args)
    np.save(tmp_path / "w.npy", third.weight_bits)  # uint16: bf16 bits
    np.save(tmp_path / "b.npy", third.bias)
    up = run(
        "--json",
        "upload",
        "cli",
        str(tmp_path / "w.npy"),
        "--bias",
        str(tmp_path / "b.npy"),
        "--vocab-size",
        str(third.vocab),
        "--chunk-mb",
        "0.01",
    )
    assert up.returncode == 0, up.stderr
    first = json.loads(up.stdout)
    assert first["version"] == 1
    assert first["weights_sha256"] == detlogp.lm_head_sha256(
        third.weight_bits, third.bias, third.vocab
    )
    up = run(
        "--json",
        "upload",
        "cli",
        str(trained.path),
        "--bias-tensor",
        "lm_head.bias",
        "--vocab-size",
        str(trained.vocab),
        "--version",
        "2",
    )
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["version"] == 2
    assert json.loads(up.stdout)["weights_sha256"] == detlogp.lm_head_sha256(
        trained.weight_bits, trained.bias, trained.vocab
    )

    (root / "cli-files").mkdir()
    shutil.copy(trained.path, root / "cli-files" / "lm.safetensors")
    loaded = run(
        "--json",
        "load",
        "cli-loaded",
        "cli-files/lm.safetensors",
        "--bias-tensor",
        "lm_head.bias",
        "--vocab-size",
        str(trained.vocab),
    )
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout)["determinism_key"] == json.loads(up.stdout)["determinism_key"]

    listing = run("--json", "models")
    assert listing.returncode == 0, listing.stderr
    models = json.loads(listing.stdout)["models"]
    assert [v["version"] for v in models["cli"]] == [1, 2]
    assert models["cli"][0]["state"] == "READY"
    assert "cli" in run("models").stdout

    hidden, targets = _rows(third, seed=13, n=3)
    np.save(tmp_path / "h.npy", hidden)
    np.save(tmp_path / "t.npy", targets)
    score = run(
        "--json",
        "score",
        "--hidden",
        str(tmp_path / "h.npy"),
        "--targets",
        str(tmp_path / "t.npy"),
        "--model",
        "cli",
        "--version",
        "1",
    )
    assert score.returncode == 0, score.stderr
    scored = json.loads(score.stdout)
    assert (scored["model"], scored["model_version"]) == ("cli", 1)
    with detlogp.Client(live.target) as client:
        want = client.logprobs(hidden, targets, model="cli", version=1)
    assert np.array_equal(
        np.array([r["logprob"] for r in scored["rows"]], np.float32), want.logprobs
    )
    info = run("--json", "info", "--model", "cli")
    assert json.loads(info.stdout)["model_version"] == 2

    unload = run("unload", "cli", "1")
    assert unload.returncode == 0, unload.stderr
    gone = run("score", "--rows", "1", "--model", "cli", "--version", "1")
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr and "model_version" in gone.stderr
    denied = run("load", "cli-loaded", "../escape.safetensors")
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
