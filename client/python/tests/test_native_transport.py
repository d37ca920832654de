"""Large calls sent by the C++ client (detlogp/native.py, native_transport)
give the bits, fields and errors of the same calls sent through grpcio:
cut to the server's row limit, spread over connections, in any wire dtype,
with lse, entropy and top-k; and the client chooses grpcio where the C++
client does not apply."""

import logging

import detlogp
import numpy as np
import pytest
from detlogp import native, tensors

pytestmark = pytest.mark.skipif(
    native.find_library() is None,
    reason="libdetlogp_client.so not built (bazel build //client/capi:libdetlogp_client.so)",
)

EXTRAS = dict(return_lse=True, return_entropy=True, top_k=3)
FIELDS = ("logprobs", "lse", "entropy", "top_ids", "top_logprobs")


def options(mode, **more):
    # Calls of 1 KiB of rows count as large here, so the test's small model
    # takes the C++ client's path.
    return detlogp.TransferOptions(
        shared_memory="off", native_transport=mode, auto_connections_min_bytes=1 << 10, **more
    )


def score(target, mode, hidden, targets, **kwargs):
    with detlogp.Client(target, timeout=60, transfer_options=options(mode)) as client:
        return client.logprobs(hidden, targets, timing=True, **kwargs)


def assert_same_answer(got, want):
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tobytes() == b.tobytes(), name
    for name in ("determinism_key", "model", "model_version", "request_id"):
        assert getattr(got, name) == getattr(want, name), name


@pytest.mark.parametrize("wire", ["float32", "bf16_bits", "float16"])
def test_the_cpp_client_gives_the_bits_of_grpcio(server, model, max_request_rows, wire):
    # Over 1,024 rows: the C++ client asks the server's limits and cuts.
    hidden, targets = model.random_rows(20 * max_request_rows + 5, seed=401)
    if wire == "bf16_bits":
        hidden = tensors.float32_to_bf16_bits(hidden)
    elif wire == "float16":
        hidden = hidden.astype(np.float16)
    want = score(server.target, "off", hidden, targets, request_id="r1", **EXTRAS)
    got = score(server.target, "on", hidden, targets, request_id="r1", **EXTRAS)
    assert not want.timings.native and want.engine == "python" and want.path == "grpc"
    assert got.timings.native and got.engine == "native" and got.path == "grpc"
    assert got.timings.slices == 21  # cut to the server's row limit
    assert got.timings.server_reported
    assert_same_answer(got, want)
    plain = score(server.target, "on", hidden, targets, temperature=0.7)
    assert plain.lse is None and plain.entropy is None and plain.top_ids is None
    assert plain.logprobs.tobytes() == (
        score(server.target, "off", hidden, targets, temperature=0.7).logprobs.tobytes()
    )


def test_a_bad_row_gets_the_error_grpcio_gives(server, model, max_request_rows):
    hidden, targets = model.random_rows(20 * max_request_rows, seed=402)
    row = 17 * max_request_rows + 5
    targets[row] = model.vocab
    errors = {}
    for mode in ("off", "on"):
        with pytest.raises(detlogp.InvalidArgument) as error:
            score(server.target, mode, hidden, targets)
        errors[mode] = error.value
    assert errors["on"].field == f"target_ids[{row}]", errors["on"].details
    assert errors["on"].details == errors["off"].details
    # Both from the server's details: the C++ client's error is the call's.
    assert errors["on"].reason == errors["off"].reason == "INVALID_FIELD"


def test_the_cpp_client_spreads_by_the_transfer_options(server, model):
    hidden, targets = model.random_rows(1000, seed=406)
    want = score(server.target, "off", hidden, targets, **EXTRAS)
    spread = options(
        # 50-row requests: under the server's 64-row limit.
        "on",
        connections=2,
        slice_bytes=50 * hidden.shape[1] * 4,
        slices_in_flight_per_connection=3,
    )
    with detlogp.Client(server.target, timeout=60, transfer_options=spread) as client:
        got = client.logprobs(hidden, targets, timing=True, **EXTRAS)
    assert got.timings.native
    assert (got.timings.slices, got.timings.connections) == (20, 2)
    assert_same_answer(got, want)


def test_rows_said_to_be_on_a_gpu_that_are_not_are_refused_naming_rows_data(server, model):
    """The device path of the C ABI checks the pointer itself (the server
    never sees it): host memory, or no CUDA runtime at all, is refused."""
    from types import SimpleNamespace

    from detlogp._common import logprob_fields
    from detlogp.transfer import LogProbCall

    hidden, targets = model.random_rows(64, seed=407)
    call = LogProbCall(hidden, targets, logprob_fields("", 1.0, False, None, None, False, 0, False))
    host = call.host_rows()
    call.cuda_tensor = SimpleNamespace(
        data_ptr=lambda: host.ctypes.data, device=SimpleNamespace(index=0)
    )
    call.cuda_stream = SimpleNamespace(cuda_stream=None)
    client = native.NativeClient(
        native.load_library(), server.target, 60, 1 << 28, detlogp.TransferOptions(), {}
    )
    try:
        with pytest.raises(native.NativeCallFailed) as failed:
            client.score(call, on_device=True)
    finally:
        client.close()
    assert failed.value.message.startswith("rows.data:"), failed.value
    assert failed.value.code in (3, 9), failed.value  # INVALID_ARGUMENT, FAILED_PRECONDITION


_INSTALLED_CLIENT_SCRIPT = """
import sys
import numpy as np
import detlogp
from detlogp import native
folder, target = sys.argv[1], sys.argv[2]
hidden, targets = np.load(f"{folder}/hidden.npy"), np.load(f"{folder}/targets.npy")
options = detlogp.TransferOptions(
    shared_memory="off", native_transport="on", auto_connections_min_bytes=1 << 10
)
with detlogp.Client(target, timeout=60, transfer_options=options) as client:
    result = client.logprobs(hidden, targets, timing=True)
assert result.timings.native, result.timings
np.save(f"{folder}/logp.npy", result.logprobs)
print(native.find_library())
"""


def test_the_installed_package_carries_the_cpp_client(server, model, tmp_path):
    """`pip install ./client/python` builds libdetlogp_client.so into the
    package where gRPC's C++ build is found: outside the repository, with no
    variable set, large calls go through it with grpcio's bits."""
    import os
    import shutil
    import subprocess
    import sys

    if not all(shutil.which(t) for t in ("protoc", "grpc_cpp_plugin", "pkg-config")):
        pytest.skip("no gRPC C++ build here: the package is installed without the library")
    hidden, targets = model.random_rows(300, seed=408)
    np.save(tmp_path / "hidden.npy", hidden)
    np.save(tmp_path / "targets.npy", targets)
    env = {k: v for k, v in os.environ.items() if k != native.LIBRARY_ENV}
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
    want = score(server.target, "off", hidden, targets)
    assert np.load(tmp_path / "logp.npy").tobytes() == want.logprobs.tobytes()


def test_grpcio_sends_what_the_cpp_client_does_not_take(server, model):
    hidden, targets = model.random_rows(60, seed=403)  # one request
    with detlogp.Client(server.target, timeout=60, transfer_options=options("auto")) as client:
        small = detlogp.TransferOptions(
            shared_memory="off", native_transport="auto", auto_connections_min_bytes=1 << 30
        )
        assert client.logprobs(hidden, targets, timing=True).timings.native
        # A call's own deadline goes with it to the C++ client.
        assert client.logprobs(hidden, targets, timing=True, timeout=5).timings.native
    with detlogp.Client(server.target, timeout=60, transfer_options=small) as client:
        assert not client.logprobs(hidden, targets, timing=True).timings.native
    # Several targets: the C++ client takes one.
    pair = [server.target, server.target]
    with detlogp.Client(pair, timeout=60, transfer_options=options("auto")) as client:
        assert not client.logprobs(hidden, targets, timing=True).timings.native
    with detlogp.Client(pair, timeout=60, transfer_options=options("on")) as client:
        with pytest.raises(RuntimeError, match="several targets"):
            client.logprobs(hidden, targets)


def test_without_the_library_auto_uses_grpcio_and_on_says_why(
    server, model, monkeypatch, tmp_path, caplog
):
    missing = tmp_path / "libdetlogp_client.so"
    monkeypatch.setenv(native.LIBRARY_ENV, str(missing))
    hidden, targets = model.random_rows(200, seed=404)
    with caplog.at_level(logging.INFO, logger="detlogp"):
        result = score(server.target, "auto", hidden, targets)
    assert any("go through grpcio" in r.getMessage() for r in caplog.records)
    assert result.logprobs.shape == (200,)
    with pytest.raises(RuntimeError, match="native_transport='on'.*cannot load"):
        score(server.target, "on", hidden, targets)


def test_the_cpp_client_keeps_a_calls_own_deadline(server, model, max_request_rows):
    """Every request the call is cut into ends by the call's deadline, not
    by the client's timeout from its own start."""
    from detlogp._common import logprob_fields
    from detlogp.transfer import LogProbCall

    hidden, targets = model.random_rows(400 * max_request_rows, seed=408)
    call = LogProbCall(hidden, targets, logprob_fields("", 1.0, False, None, None, False, 0, False))
    client = native.NativeClient(
        native.load_library(), server.target, 60, 1 << 28, detlogp.TransferOptions(), {}
    )
    try:
        with pytest.raises(native.NativeCallFailed) as failed:
            client.score(call, timeout=0.002)
        result, path = client.score(call, timeout=60)
    finally:
        client.close()
    assert failed.value.code == 4, failed.value  # DEADLINE_EXCEEDED
    assert path == "grpc"
    assert result.logprobs.shape == (len(targets),)


def test_native_transport_is_checked():
    with pytest.raises(ValueError, match="TransferOptions.native_transport"):
        detlogp.TransferOptions(native_transport="always").validated()


def test_the_asyncio_client_sends_large_calls_the_same_way(server, model, max_request_rows):
    import asyncio

    from detlogp.aio import AsyncClient

    hidden, targets = model.random_rows(20 * max_request_rows + 3, seed=405)
    want = score(server.target, "off", hidden, targets, **EXTRAS)

    async def run():
        async with AsyncClient(server.target, timeout=60, transfer_options=options("on")) as client:
            return await client.logprobs(hidden, targets, timing=True, **EXTRAS)

    got = asyncio.run(run())
    assert got.timings.native
    assert_same_answer(got, want)


def test_beside_grpcio_tools_protoc_the_cpp_client_is_not_loaded(server, model, monkeypatch):
    """grpcio-tools' protoc carries its own protobuf: the C++ client's
    library is not loaded beside it (that aborts); calls use grpcio."""
    import sys

    monkeypatch.setitem(sys.modules, "grpc_tools._protoc_compiler", sys)
    hidden, targets = model.random_rows(60, seed=406)
    assert not score(server.target, "auto", hidden, targets).timings.native
    with pytest.raises(RuntimeError, match="grpc_tools._protoc_compiler is loaded"):
        score(server.target, "on", hidden, targets)
