"""Calls sent by the C++ engine (detlogp/engine.py, C ABI v5) give the bits
of the same rows sent in small requests through grpcio: cut to the server's
row limit, spread over connections, in any wire dtype, with lse, entropy and
top-k, from the sync client and from the asyncio one (which awaits the
engine's completion callback). Every call asserts the engine and the path
its rows took; the path is chosen before a call is sent and never changes
because of a server's answer."""

import asyncio
import logging
import sys

import detlogp
import numpy as np
import pytest
from detlogp import calls, engine, tensors
from detlogp._common import logprob_fields
from detlogp.aio import AsyncClient

pytestmark = pytest.mark.skipif(
    engine.find_library() is None,
    reason="libdetlogp_client.so not built (bazel build //client/capi:libdetlogp_client.so)",
)

EXTRAS = dict(return_lse=True, return_entropy=True, top_k=3)
FIELDS = ("logprobs", "lse", "entropy", "top_ids", "top_logprobs")


def options(mode="auto", **more):
    return detlogp.TransferOptions(shared_memory="off", native_transport=mode, **more)


def score(target, hidden, targets, mode="auto", **kwargs):
    with detlogp.Client(target, timeout=60, transfer_options=options(mode)) as client:
        return client.logprobs(hidden, targets, timing=True, **kwargs)


def in_small_calls(target, hidden, targets, rows, **kwargs):
    """The rows scored `rows` at a time, each one grpcio request: what a
    call through the engine must equal, field by field."""
    with detlogp.Client(target, timeout=60, transfer_options=options("off")) as client:
        parts = []
        for start in range(0, len(targets), rows):
            part = client.logprobs(
                hidden[start : start + rows], targets[start : start + rows], **kwargs
            )
            assert (part.engine, part.path) == ("python", "grpc")
            parts.append(part)
    return parts


def assert_same_answer(got, parts):
    for name in FIELDS:
        if getattr(parts[0], name) is None:
            assert getattr(got, name) is None, name
            continue
        want = np.concatenate([getattr(p, name) for p in parts])
        value = getattr(got, name)
        assert value.dtype == want.dtype and value.shape == want.shape, name
        assert value.tobytes() == want.tobytes(), name
    for name in ("determinism_key", "model", "model_version"):
        assert getattr(got, name) == getattr(parts[0], name), name


def new_call(hidden, targets):
    fields = logprob_fields("", 1.0, False, None, None, False, 0, False)
    return calls.LogProbCall(hidden, targets, fields)


@pytest.mark.parametrize("wire", ["float32", "bf16_bits", "float16"])
def test_the_engine_gives_the_bits_of_small_calls(server, model, max_request_rows, wire):
    hidden, targets = model.random_rows(20 * max_request_rows + 5, seed=401)
    if wire == "bf16_bits":
        hidden = tensors.float32_to_bf16_bits(hidden)
    elif wire == "float16":
        hidden = hidden.astype(np.float16)
    got = score(server.target, hidden, targets, request_id="r1", **EXTRAS)
    assert (got.engine, got.path) == ("native", "grpc")
    assert got.timings.native and got.timings.path == "grpc"
    assert got.timings.slices == 21  # cut to the server's row limit
    assert got.timings.server_reported
    assert got.request_id == "r1"
    assert_same_answer(
        got, in_small_calls(server.target, hidden, targets, max_request_rows, **EXTRAS)
    )
    plain = score(server.target, hidden, targets, temperature=0.7)
    assert plain.engine == "native"
    assert plain.lse is None and plain.entropy is None and plain.top_ids is None
    assert_same_answer(
        plain, in_small_calls(server.target, hidden, targets, max_request_rows, temperature=0.7)
    )


def test_a_bad_row_is_named_by_its_row_in_the_call_from_the_servers_details(
    server, model, max_request_rows
):
    hidden, targets = model.random_rows(20 * max_request_rows, seed=402)
    row = 17 * max_request_rows + 5
    targets[row] = model.vocab
    with pytest.raises(detlogp.InvalidArgument) as error:
        score(server.target, hidden, targets)
    assert error.value.field == f"target_ids[{row}]", error.value.details
    assert error.value.reason == "INVALID_FIELD"


def test_the_engine_spreads_by_the_transfer_options(server, model, max_request_rows):
    hidden, targets = model.random_rows(1000, seed=406)
    spread = options(
        # 50-row requests: under the server's 64-row limit.
        connections=2,
        slice_bytes=50 * hidden.shape[1] * 4,
        slices_in_flight_per_connection=3,
    )
    with detlogp.Client(server.target, timeout=60, transfer_options=spread) as client:
        got = client.logprobs(hidden, targets, timing=True, **EXTRAS)
    assert got.timings.native and got.path == "grpc"
    assert (got.timings.slices, got.timings.connections) == (20, 2)
    assert_same_answer(got, in_small_calls(server.target, hidden, targets, 50, **EXTRAS))


def test_the_path_is_chosen_by_the_call_alone(server, model, max_request_rows):
    """One request's worth goes through grpcio; more rows than the server
    takes, or more bytes than engine_min_bytes, through the engine; with
    several targets, each target's engine in turn."""
    hidden, targets = model.random_rows(max_request_rows, seed=403)
    with detlogp.Client(server.target, timeout=60, transfer_options=options()) as client:
        small = client.logprobs(hidden, targets, timing=True)
        assert (small.engine, small.path) == ("python", "grpc")
        assert not small.timings.native and small.timings.slices == 1
        large = client.logprobs(np.vstack([hidden, hidden]), np.concatenate([targets] * 2))
        assert (large.engine, large.path) == ("native", "grpc")
        # A call's own deadline goes with it to the engine.
        again = client.logprobs(
            np.vstack([hidden, hidden]), np.concatenate([targets] * 2), timeout=5
        )
        assert again.engine == "native"
    by_bytes = options(engine_min_bytes=hidden.nbytes)
    with detlogp.Client(server.target, timeout=60, transfer_options=by_bytes) as client:
        assert client.logprobs(hidden, targets).engine == "native"
        assert client.logprobs(hidden[:-1], targets[:-1]).engine == "python"
    pair = [server.target, server.target]
    rows, ids = model.random_rows(3 * max_request_rows, seed=409)
    with detlogp.Client(pair, timeout=60, transfer_options=options()) as client:
        results = [client.logprobs(rows, ids) for _ in range(2)]
    assert [r.engine for r in results] == ["native", "native"]
    assert results[0].logprobs.tobytes() == results[1].logprobs.tobytes()


def test_without_the_library_one_request_works_and_more_says_what_is_needed(
    server, model, max_request_rows, monkeypatch, tmp_path, caplog
):
    missing = tmp_path / "libdetlogp_client.so"
    monkeypatch.setenv(engine.LIBRARY_ENV, str(missing))
    hidden, targets = model.random_rows(max_request_rows, seed=404)
    with caplog.at_level(logging.INFO, logger="detlogp"):
        small = score(server.target, hidden, targets)
    assert any("need the C++ engine" in r.getMessage() for r in caplog.records)
    assert (small.engine, small.path) == ("python", "grpc")
    with pytest.raises(detlogp.EngineRequired, match="libdetlogp_client.so"):
        score(server.target, np.vstack([hidden, hidden]), np.concatenate([targets] * 2))
    with pytest.raises(RuntimeError, match="native_transport='on'.*cannot load"):
        score(server.target, hidden, targets, mode="on")


def test_off_sends_one_request_and_refuses_more(server, model, max_request_rows):
    hidden, targets = model.random_rows(max_request_rows + 1, seed=410)
    with pytest.raises(detlogp.EngineRequired, match=f"{max_request_rows} rows"):
        score(server.target, hidden, targets, mode="off")


def test_a_calls_own_deadline_fails_it_with_deadline_exceeded(server, model, max_request_rows):
    """Every request the call is cut into ends by the call's deadline, not
    by the client's timeout from its own start; the error is the engine's
    own, with its details."""
    hidden, targets = model.random_rows(400 * max_request_rows, seed=408)
    with detlogp.Client(server.target, timeout=60, transfer_options=options()) as client:
        with pytest.raises(detlogp.DeadlineExceeded) as failed:
            client.logprobs(hidden, targets, timeout=0.002)
        result = client.logprobs(hidden, targets, timeout=60)
    assert failed.value.reason, failed.value
    assert (result.engine, result.path) == ("native", "grpc")
    assert result.logprobs.shape == (len(targets),)


def test_rows_said_to_be_on_a_gpu_that_are_not_are_refused_naming_rows_data(server, model):
    """The device path of the C ABI checks the pointer itself (the server
    never sees it): host memory, or no CUDA runtime at all, is refused."""
    from types import SimpleNamespace

    hidden, targets = model.random_rows(64, seed=407)
    call = new_call(hidden, targets)
    host = call.host_rows()
    call.cuda_tensor = SimpleNamespace(
        data_ptr=lambda: host.ctypes.data,
        device=SimpleNamespace(index=0),
        is_contiguous=lambda: True,
    )
    call.cuda_stream = SimpleNamespace(cuda_stream=None)
    settings = engine.EngineSettings(
        targets=[server.target],
        timeout=60,
        max_message_bytes=1 << 28,
        connections=0,
        request_bytes=8 << 20,
        requests_in_flight=2,
        system_shared_memory=False,
        cuda_shared_memory=True,
        channel_args=[],
        security={},
    )
    made = engine.Engine(engine.load_library(), settings)
    try:
        with pytest.raises((detlogp.InvalidArgument, detlogp.FailedPrecondition)) as failed:
            made.score(call)
    finally:
        made.close()
    assert failed.value.details.startswith("rows.data:"), failed.value


def test_channel_args_the_engine_does_not_take_are_refused_by_their_key(server, model):
    hidden, targets = model.random_rows(200, seed=411)
    keepalive = [("grpc.keepalive_time_ms", 20000), ("grpc.lb_policy_name", "pick_first")]
    with detlogp.Client(server.target, timeout=60, channel_args=keepalive) as client:
        assert client.logprobs(hidden, targets).engine == "native"
    with pytest.raises(ValueError, match='channel_args: "grpc.primary_user_agent"'):
        detlogp.Client(server.target, channel_args=[("grpc.primary_user_agent", "x")])
    off = options("off")
    with detlogp.Client(
        server.target, channel_args=[("grpc.primary_user_agent", "x")], transfer_options=off
    ) as client:
        assert client.logprobs(hidden[:10], targets[:10]).engine == "python"


def test_native_transport_is_checked():
    with pytest.raises(ValueError, match="TransferOptions.native_transport"):
        detlogp.TransferOptions(native_transport="always").validated()


def test_the_asyncio_client_awaits_the_engine_many_calls_at_once(server, model, max_request_rows):
    """More calls at once than the engine has threads for callbacks: each
    answered once, in its own bits; a cancelled call leaves the others."""
    hidden, targets = model.random_rows(20 * max_request_rows + 3, seed=405)
    want = in_small_calls(server.target, hidden, targets, max_request_rows, **EXTRAS)

    async def run():
        async with AsyncClient(server.target, timeout=60, transfer_options=options("on")) as client:
            cancelled = asyncio.ensure_future(client.logprobs(hidden, targets))
            await asyncio.sleep(0)
            cancelled.cancel()
            calls_at_once = [
                client.logprobs(
                    hidden[: len(targets) - i], targets[: len(targets) - i], timing=True, **EXTRAS
                )
                for i in range(20)
            ]
            answers = await asyncio.gather(*calls_at_once)
            # Cancelled while the engine has it: the engine finishes it.
            late = asyncio.ensure_future(client.logprobs(hidden, targets))
            await asyncio.sleep(0.001)
            late.cancel()
            assert (await client.logprobs(hidden, targets)).engine == "native"
            return answers

    got = asyncio.run(run())
    assert all((g.engine, g.path) == ("native", "grpc") and g.timings.native for g in got)
    assert_same_answer(got[0], want)
    whole = {name: np.concatenate([getattr(p, name) for p in want]) for name in FIELDS}
    for i, result in enumerate(got):
        for name in FIELDS:
            assert getattr(result, name).tobytes() == whole[name][: len(targets) - i].tobytes()


def test_the_asyncio_client_raises_the_engines_error(server, model, max_request_rows):
    hidden, targets = model.random_rows(3 * max_request_rows, seed=412)
    targets[-1] = model.vocab

    async def run():
        async with AsyncClient(server.target, timeout=60, transfer_options=options()) as client:
            return await client.logprobs(hidden, targets)

    with pytest.raises(detlogp.InvalidArgument) as error:
        asyncio.run(run())
    assert error.value.field == f"target_ids[{len(targets) - 1}]"


def test_beside_grpcio_tools_protoc_the_engine_is_not_loaded(server, model, monkeypatch):
    """grpcio-tools' protoc carries its own protobuf: the engine's library is
    not loaded beside it (that aborts); one request still goes."""
    monkeypatch.setitem(sys.modules, "grpc_tools._protoc_compiler", sys)
    hidden, targets = model.random_rows(60, seed=406)
    assert score(server.target, hidden, targets).engine == "python"
    with pytest.raises(RuntimeError, match="grpc_tools._protoc_compiler is loaded"):
        score(server.target, hidden, targets, mode="on")


_INSTALLED_CLIENT_SCRIPT = """
import sys
import numpy as np
import detlogp
from detlogp import engine
folder, target = sys.argv[1], sys.argv[2]
hidden, targets = np.load(f"{folder}/hidden.npy"), np.load(f"{folder}/targets.npy")
options = detlogp.TransferOptions(shared_memory="off", native_transport="on")
with detlogp.Client(target, timeout=60, transfer_options=options) as client:
    result = client.logprobs(hidden, targets, timing=True)
assert result.engine == "native", result
np.save(f"{folder}/logp.npy", result.logprobs)
print(engine.find_library())
"""


def test_the_installed_package_carries_the_engine(server, model, max_request_rows, tmp_path):
    """`pip install ./client/python` builds libdetlogp_client.so into the
    package where gRPC's C++ build is found: outside the repository, with no
    variable set, large calls go through it with grpcio's bits."""
    import os
    import shutil
    import subprocess

    if not all(shutil.which(t) for t in ("protoc", "grpc_cpp_plugin", "pkg-config")):
        pytest.skip("no gRPC C++ build here: the package is installed without the library")
    hidden, targets = model.random_rows(300, seed=408)
    np.save(tmp_path / "hidden.npy", hidden)
    np.save(tmp_path / "targets.npy", targets)
    env = {k: v for k, v in os.environ.items() if k != engine.LIBRARY_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _INSTALLED_CLIENT_SCRIPT, str(tmp_path), server.target],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    from detlogp import libraries

    assert out.stdout.split()[-1] == str(libraries.PACKAGE_LIB_DIR / "libdetlogp_client.so"), (
        "the installed package has no libdetlogp_client.so: install it with "
        "`pip install ./client/python` (tools/test_python.sh does)"
    )
    want = in_small_calls(server.target, hidden, targets, max_request_rows)
    assert (
        np.load(tmp_path / "logp.npy").tobytes()
        == np.concatenate([p.logprobs for p in want]).tobytes()
    )


def test_a_dns_target_is_a_replica_per_address_in_the_engine(server, model, max_request_rows):
    """dns:///localhost:<port>: the engine resolves the name (127.0.0.1, and
    ::1 where nothing listens: its requests move to 127.0.0.1 within the
    call) and the answer has the bits of the rows in small calls."""
    port = server.target.rsplit(":", 1)[1]
    hidden, targets = model.random_rows(20 * max_request_rows + 3, seed=409)
    got = score(f"dns:///localhost:{port}", hidden, targets, **EXTRAS)
    assert (got.engine, got.path) == ("native", "grpc")
    assert_same_answer(
        got, in_small_calls(server.target, hidden, targets, max_request_rows, **EXTRAS)
    )
