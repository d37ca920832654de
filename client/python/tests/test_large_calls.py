"""Calls larger than the server takes in one request go through the C++
engine: cut, sent side by side over several connections (and replicas),
put back in order, with the bits of the same rows sent in small requests,
for logprobs, lse, entropy and top-k, from the sync and the asyncio client,
over TCP and the Unix socket. Every call asserts the engine and the path
its rows took. Shared memory is off here (test_shared_memory.py has it)."""

import asyncio
import pathlib
import tempfile

import detlogp
import numpy as np
import pytest
from detlogp import engine, requests, tensors
from detlogp.aio import AsyncClient
from detlogp.testing import LocalServer, TestModel

pytestmark = pytest.mark.skipif(
    engine.find_library() is None,
    reason="libdetlogp_client.so not built (bazel build //client/capi:libdetlogp_client.so)",
)

OFF = detlogp.TransferOptions(shared_memory="off")
EXTRAS = dict(return_lse=True, return_entropy=True, top_k=3)
FIELDS = ("logprobs", "lse", "entropy", "top_ids", "top_logprobs")


def in_small_requests(client, hidden, targets, rows, **extras):
    """The rows sent `rows` at a time through the generated classes (the
    protobuf path, one request each): what a split call must equal."""
    parts = []
    for start in range(0, len(targets), rows):
        request = requests.logprob_request(
            hidden[start : start + rows], targets[start : start + rows], **extras
        )
        parts.append(detlogp.results.logprob_result(client.compute(request), request))
    return {
        name: np.concatenate([getattr(p, name) for p in parts])
        for name in FIELDS
        if getattr(parts[0], name) is not None
    }


def assert_engine_over_grpc(result):
    assert (result.engine, result.path) == ("native", "grpc"), result
    if result.timings is not None:
        assert result.timings.native and result.timings.path == "grpc", result.timings


def assert_same_bits(result, want):
    for name, values in want.items():
        got = getattr(result, name)
        assert got.dtype == values.dtype and got.shape == values.shape, name
        assert got.tobytes() == values.tobytes(), name


def test_a_call_over_the_row_limit_is_cut_and_keeps_its_bits(server, model, max_request_rows):
    hidden, targets = model.random_rows(10 * max_request_rows + 7, seed=301)
    with detlogp.Client(server.target, timeout=60, transfer_options=OFF) as client:
        result = client.logprobs(hidden, targets, timing=True, **EXTRAS)
        assert result.timings.slices == 11
        assert_engine_over_grpc(result)
        assert_same_bits(result, in_small_requests(client, hidden, targets, 50, **EXTRAS))
        assert result.logprobs.flags.writeable


def test_striped_calls_keep_their_bits(server, model):
    hidden, targets = model.random_rows(1000, seed=302)
    hidden = tensors.float32_to_bf16_bits(hidden)
    options = detlogp.TransferOptions(
        shared_memory="off", connections=3, slice_bytes=40 * model.hidden * 2
    )
    with detlogp.Client(server.target, timeout=60, transfer_options=options) as client:
        result = client.logprobs(hidden, targets, timing=True, **EXTRAS)
        assert result.timings.connections == 3
        assert result.timings.slices == 25
        assert_engine_over_grpc(result)
        assert_same_bits(result, in_small_requests(client, hidden, targets, 64, **EXTRAS))
        again = client.logprobs(hidden, targets, **EXTRAS)  # connections reused
        assert_engine_over_grpc(again)
        assert_same_bits(again, {n: getattr(result, n) for n in FIELDS})


def test_a_bad_row_is_named_by_its_row_in_the_call(server, model, max_request_rows):
    hidden, targets = model.random_rows(3 * max_request_rows, seed=303)
    targets[2 * max_request_rows + 5] = model.vocab
    with detlogp.Client(server.target, timeout=30, transfer_options=OFF) as client:
        with pytest.raises(detlogp.InvalidArgument) as error:
            client.logprobs(hidden, targets)
    assert error.value.field == f"target_ids[{2 * max_request_rows + 5}]", error.value.details


@pytest.fixture(scope="module")
def big_server(server_binary):
    """A small H, a 1 MiB message limit and a Unix socket."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="detlogp-large-"))
    model = TestModel(folder, hidden=256, vocab=100, padded_vocab=128, seed=9)
    socket = folder / "detlogp.sock"
    flags = model.flags + [
        "--max_request_rows=65536",
        "--max_message_mb=1",
        f"--unix_socket={socket}",
        "--cpu_threads=1",
    ]
    with LocalServer(server_binary, flags) as server:
        server.model = model
        server.unix_target = f"unix:{socket}"
        yield server


def test_a_call_over_the_message_limit_is_cut_below_it(big_server):
    """1000 float32 rows of H=256 are 1 MB: over the server's 1 MiB limit
    with the ids; the client never sends a message the server refuses."""
    model = big_server.model
    hidden, targets = model.random_rows(1200, seed=305)
    options = detlogp.TransferOptions(shared_memory="off", slice_bytes=1 << 30)
    with detlogp.Client(big_server.target, timeout=60, transfer_options=options) as client:
        result = client.logprobs(hidden, targets, timing=True, **EXTRAS)
        assert result.timings.slices == 2
        assert_engine_over_grpc(result)
        assert_same_bits(result, in_small_requests(client, hidden, targets, 400, **EXTRAS))


def test_a_message_over_a_limit_is_message_too_large_not_overloaded(big_server):
    model = big_server.model
    hidden, targets = model.random_rows(1100, seed=306)
    request = requests.logprob_request(hidden, targets)
    with detlogp.Client(big_server.target, timeout=30) as client:
        with pytest.raises(detlogp.MessageTooLarge) as error:
            client.compute(request)
    assert not isinstance(error.value, detlogp.Overloaded)
    assert error.value.limit_bytes == 1 << 20
    assert error.value.size_bytes == request.ByteSize()
    print(error.value)
    # A call over the message limit is cut below it by the engine.
    with detlogp.Client(
        big_server.target, timeout=30, max_message_mb=1, transfer_options=OFF
    ) as client:
        few = np.zeros((8000, model.hidden), np.uint16)
        result = client.logprobs(few, np.zeros(8000, np.int64), top_k=20, timing=True)
        assert result.timings.slices >= 2
        assert_engine_over_grpc(result)
        assert result.top_ids.shape == (8000, 20)


def test_the_unix_socket_gives_the_same_bits(big_server):
    model = big_server.model
    hidden, targets = model.random_rows(3000, seed=307)
    with detlogp.Client(big_server.target, timeout=60, transfer_options=OFF) as tcp:
        want = tcp.logprobs(hidden, targets, **EXTRAS)
    with detlogp.Client(big_server.unix_target, timeout=60, transfer_options=OFF) as unix:
        got = unix.logprobs(hidden, targets, **EXTRAS)
    assert_engine_over_grpc(want)
    assert_engine_over_grpc(got)
    assert_same_bits(got, {n: getattr(want, n) for n in FIELDS})


def test_a_million_rows_in_one_call(big_server):
    """1,048,576 bf16 rows (H=256: 512 MiB) in one logprobs() call, equal to
    the same rows in 4,096-row calls (32 of the 256 blocks, first and last
    among them)."""
    model = big_server.model
    rows = 1 << 20
    rng = np.random.default_rng(308)
    hidden = tensors.float32_to_bf16_bits(rng.standard_normal((rows, model.hidden), np.float32))
    targets = rng.integers(0, model.vocab, rows)
    with detlogp.Client(big_server.unix_target, timeout=600, transfer_options=OFF) as client:
        result = client.logprobs(hidden, targets, return_lse=True, timing=True)
        print(f"1,048,576 rows: {result.timings}")
        assert_engine_over_grpc(result)
        assert result.logprobs.shape == (rows,)
        for start in np.linspace(0, rows - 4096, 32).astype(int) // 4096 * 4096:
            part = client.logprobs(
                hidden[start : start + 4096], targets[start : start + 4096], return_lse=True
            )
            assert part.logprobs.tobytes() == result.logprobs[start : start + 4096].tobytes()
            assert part.lse.tobytes() == result.lse[start : start + 4096].tobytes()


def test_round_robin_spreads_slices_over_replicas(server_binary, model, max_request_rows):
    """An ipv4: list (as a dns:/// name with several addresses) gets
    round_robin: one client's large call reaches every replica."""
    flags = model.flags + [f"--max_request_rows={max_request_rows}", "--cpu_threads=1"]
    hidden, targets = model.random_rows(40 * max_request_rows, seed=309)
    with LocalServer(server_binary, flags) as first, LocalServer(server_binary, flags) as second:
        target = f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
        with detlogp.Client(target, timeout=60, transfer_options=OFF) as client:
            result = client.logprobs(hidden, targets)
        with detlogp.Client(first.target, timeout=60, transfer_options=OFF) as one:
            want = one.logprobs(hidden, targets)
        assert_engine_over_grpc(result)
        first.terminate()
        second.terminate()
        computed = [first.stop_counts()["computed"], second.stop_counts()["computed"]]
    print(f"rows computed per replica: {computed}")
    assert result.logprobs.tobytes() == want.logprobs.tobytes()
    assert computed[1] > 0 and computed[0] > len(targets)


def test_round_robin_is_the_default_for_dns_targets():
    from detlogp._common import wants_round_robin

    assert wants_round_robin("dns:///detlogp-headless.default.svc.cluster.local:50051")
    assert wants_round_robin("ipv4:10.0.0.1:50051,10.0.0.2:50051")
    assert not wants_round_robin("10.0.0.1:50051")
    assert not wants_round_robin("unix:/tmp/detlogp.sock")


def test_async_client_cuts_and_stripes_alike(server, model, max_request_rows):
    hidden, targets = model.random_rows(9 * max_request_rows + 1, seed=310)
    options = detlogp.TransferOptions(shared_memory="off", connections=2)
    with detlogp.Client(server.target, timeout=60, transfer_options=OFF) as client:
        want = client.logprobs(hidden, targets, **EXTRAS)

    async def main():
        async with AsyncClient(server.target, timeout=60, transfer_options=options) as aclient:
            results = await asyncio.gather(
                *[aclient.logprobs(hidden, targets, timing=True, **EXTRAS) for _ in range(3)]
            )
            with pytest.raises(detlogp.InvalidArgument) as error:
                bad = targets.copy()
                bad[-1] = model.vocab
                await aclient.logprobs(hidden, bad)
            assert error.value.field == f"target_ids[{len(targets) - 1}]"
            return results

    for result in asyncio.run(main()):
        assert result.timings.slices == 10 and result.timings.connections == 2
        assert_engine_over_grpc(result)
        assert_same_bits(result, {n: getattr(want, n) for n in FIELDS})


def test_options_are_checked_naming_the_field(server):
    with pytest.raises(ValueError, match="TransferOptions.shared_memory"):
        detlogp.Client(server.target, shared_memory="always")
    with pytest.raises(ValueError, match="TransferOptions.slice_bytes"):
        detlogp.Client(server.target, transfer_options=detlogp.TransferOptions(slice_bytes=0))
    with pytest.raises(ValueError, match="TransferOptions.engine_min_bytes"):
        detlogp.TransferOptions(engine_min_bytes=0).validated()


def test_the_local_server_reports_the_cpu_it_used(server, model):
    # LocalServer.cpu_seconds: what the fan-out bench counts per replica.
    before = server.cpu_seconds()
    assert before >= 0
    hidden, targets = model.random_rows(20000, seed=311)
    with detlogp.Client(server.target, timeout=120, transfer_options=OFF) as client:
        client.logprobs(hidden, targets)
    used = server.cpu_seconds() - before
    print(f"20,000 rows: {used:.2f} s of the server's CPU")
    assert used > 0
