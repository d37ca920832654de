"""The `detlogp` console command, ProjectionService.Project (when the server
has it; over several calls too), and the checked-in stubs being current with
proto/."""

import asyncio
import json
import pathlib
import subprocess
import sys

import detlogp
import numpy as np
import pytest
from detlogp.v1 import detlogp_pb2

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]  # client/python


def detlogp_command():
    """The installed console script next to this interpreter, else the module."""
    script = pathlib.Path(sys.executable).with_name("detlogp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "detlogp.cli"]


def test_cli_info_and_score(server, model, client, tmp_path):
    run = lambda *args: subprocess.run(
        detlogp_command() + ["--target", server.target, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    info = run("--json", "info")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["hidden_size"] == model.hidden
    assert "determinism_key" in run("info").stdout

    hidden, targets = model.random_rows(3, seed=51)
    np.save(tmp_path / "h.npy", hidden)
    np.save(tmp_path / "t.npy", targets)
    score = run(
        "--json",
        "score",
        "--hidden",
        str(tmp_path / "h.npy"),
        "--targets",
        str(tmp_path / "t.npy"),
        "--lse",
    )
    assert score.returncode == 0, score.stderr
    rows = json.loads(score.stdout)["rows"]
    want = client.logprobs(hidden, targets)
    assert np.array_equal(np.array([r["logprob"] for r in rows], np.float32), want.logprobs)

    table = run("score", "--rows", "2", "--seed", "3")
    assert table.returncode == 0 and table.stdout.count("\nrow ") == 2, table.stdout

    # 200 rows to a server on this host taking 64 per request: through the
    # engine's system region in 4 requests, timed.
    timed = run("--json", "score", "--rows", "200", "--seed", "4", "--timing")
    assert timed.returncode == 0, timed.stderr
    timings = json.loads(timed.stdout)["timings"]
    assert timings["slices"] == 4 and timings["native"], timings
    assert timings["path"] == "system_shm", timings
    assert timings["server_reported"] and timings["compute_s"] > 0, timings
    line = run("score", "--rows", "2", "--timing").stdout.splitlines()[-1]
    assert line.startswith("timing: total") and "1 slice(s)" in line, line

    np.save(tmp_path / "bad.npy", np.full(3, model.vocab))
    bad = run("score", "--hidden", str(tmp_path / "h.npy"), "--targets", str(tmp_path / "bad.npy"))
    assert bad.returncode == 1 and "target_ids[0]" in bad.stderr


def test_project_reassembles_chunks_when_the_server_has_it(client):
    rng = np.random.default_rng(61)
    x = rng.standard_normal((10, 96)).astype(np.float32)
    try:
        whole = client.project(x, timeout=30)
    except detlogp.Unimplemented as error:
        pytest.skip(
            f"server does not implement ProjectionService.Project yet "
            f"(UNIMPLEMENTED: {error.details})"
        )
    assert whole.y.shape == (10, 5376) and whole.y.dtype == np.float32
    chunked = client.project(x, rows_per_chunk=3, timeout=30)
    assert chunked.chunks == 4
    assert chunked.y.tobytes() == whole.y.tobytes()
    alone = client.project(x[4:5], timeout=30)
    assert alone.y.tobytes() == whole.y[4:5].tobytes()


def test_project_over_several_calls_gives_one_calls_bits(server, client):
    """streams > 1: the rows go round several calls (each on its own
    connection) in blocks; Y, its key and the chunk count are one call's,
    from the sync and the asyncio client, and a refusal names the field."""
    rng = np.random.default_rng(62)
    x = rng.standard_normal((1000, 96)).astype(np.float32)
    whole = client.project(x, timeout=30)
    for streams, rows_per_chunk, chunks in [(2, 0, 2), (3, 7, 143), (8, 300, 4)]:
        spread = client.project(x, streams=streams, rows_per_chunk=rows_per_chunk, timeout=30)
        assert spread.y.tobytes() == whole.y.tobytes()
        assert (spread.determinism_key, spread.chunks) == (whole.determinism_key, chunks)

    async def run():
        async with detlogp.aio.AsyncClient(server.target, timeout=30) as aclient:
            spread = await aclient.project(x, streams=4, rows_per_chunk=64)
            with pytest.raises(detlogp.InvalidArgument) as refused:
                await aclient.project(
                    np.zeros((3 * 2049, 96), np.float32), streams=3, rows_per_chunk=2049
                )  # above the server's 2048
            return spread, refused.value.field

    spread, field = asyncio.run(run())
    assert spread.y.tobytes() == whole.y.tobytes() and spread.chunks == 16
    assert field == "rows_per_chunk"
    with pytest.raises(detlogp.InvalidArgument) as refused:
        client.project(np.zeros((3 * 2049, 96), np.float32), streams=3, rows_per_chunk=2049)
    assert refused.value.field == "rows_per_chunk"
    with pytest.raises(ValueError, match="streams"):
        client.project(x, streams=-1)


def test_checked_in_stubs_match_the_proto(tmp_path, repo_root):
    """The descriptor inside detlogp_pb2.py equals a fresh compile of proto/;
    with the pinned grpcio-tools, the files are byte-identical too.
    Fix: client/python/tools/regen_stubs.sh"""
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2

    proto_root = repo_root / "proto"
    out = tmp_path / "out"
    out.mkdir()
    # protoc in a process of its own: grpcio-tools carries a protobuf of its
    # own, which must not share this process with the C++ client's library.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={proto_root}",
            "--include_imports",
            f"--descriptor_set_out={tmp_path / 'set.pb'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(proto_root / "detlogp/v1/detlogp.proto"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    fresh = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes())
    fresh_file = [f for f in fresh.file if f.name == "detlogp/v1/detlogp.proto"][0]
    fresh_file.ClearField("source_code_info")

    def clear_json_names(messages):  # protoc adds json names to sets only
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            clear_json_names(message.nested_type)

    clear_json_names(fresh_file.message_type)
    checked_in = descriptor_pb2.FileDescriptorProto()
    detlogp_pb2.DESCRIPTOR.CopyToProto(checked_in)
    assert checked_in == fresh_file, "stubs are stale: run client/python/tools/regen_stubs.sh"

    from importlib import metadata

    pinned = "1.85.1"  # tools/regen_stubs.sh GRPCIO_TOOLS_VERSION
    if metadata.version("grpcio-tools") == pinned:
        for name in ("detlogp_pb2.py", "detlogp_pb2_grpc.py"):
            fresh_text = (out / "detlogp/v1" / name).read_text()
            assert (PACKAGE_ROOT / "detlogp/v1" / name).read_text() == fresh_text, (
                f"{name} is stale: run client/python/tools/regen_stubs.sh"
            )


def test_clients_over_the_servers_unix_socket_get_the_tcp_ports_bits(
    server_binary, model, tmp_path_factory
):
    """--unix_socket: target "unix:PATH" from the sync and asyncio clients,
    log-probs with extras and a projection over several calls, bit for bit
    the TCP port's answers."""
    import tempfile

    from detlogp.testing import LocalServer

    # A short directory: a socket path holds at most 107 bytes.
    socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="detlogp-py-"))
    socket = socket_dir / "s.sock"
    with LocalServer(
        server_binary, model.flags + ["--cpu_threads=1", f"--unix_socket={socket}"]
    ) as srv:
        hidden, targets = model.random_rows(9, seed=71)
        x = np.random.default_rng(72).standard_normal((300, 96)).astype(np.float32)
        results = {}
        for target in (srv.target, f"unix:{socket}"):
            with detlogp.Client(target, timeout=30) as c:
                rows = c.logprobs(hidden, targets, return_lse=True, return_entropy=True, top_k=3)
                y = c.project(x, streams=2, rows_per_chunk=64)
            results[target] = (rows, y)

        async def over_unix():
            async with detlogp.aio.AsyncClient(f"unix:{socket}", timeout=30) as aclient:
                return await aclient.logprobs(hidden, targets, top_k=3)

        via_async = asyncio.run(over_unix())
    (tcp_rows, tcp_y), (unix_rows, unix_y) = results.values()
    for got in (unix_rows, via_async):
        assert got.logprobs.tobytes() == tcp_rows.logprobs.tobytes()
        assert got.top_ids.tobytes() == tcp_rows.top_ids.tobytes()
        assert got.determinism_key == tcp_rows.determinism_key
    assert unix_rows.entropy.tobytes() == tcp_rows.entropy.tobytes()
    assert unix_y.y.tobytes() == tcp_y.y.tobytes() and unix_y.chunks == tcp_y.chunks
    assert not socket.exists()  # the server removes it when it stops
    socket_dir.rmdir()
