"""Shared memory from Python, through the C++ engine: rows in a system
region the engine owns (numpy arrays, CPU tensors) or a CUDA region (CUDA
tensors, GPU hosts only) give the bits gRPC bytes give; a region is
registered once and reused; a server that refuses gets bytes, the reason is
logged once and the result's path says so; close() unregisters; a client
killed with -9 leaves nothing in /dev/shm, and the server releases its
regions after --shared_memory_idle_s. Every call asserts its path."""

import asyncio
import concurrent.futures
import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import detlogp
import grpc
import pytest
from detlogp import engine, tensors
from detlogp.aio import AsyncClient
from detlogp.testing import LocalServer, TestModel, server_flags
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

EXTRAS = dict(return_lse=True, return_entropy=True, top_k=4)
FIELDS = ("logprobs", "lse", "entropy", "top_ids", "top_logprobs")
IDLE_S = 2
MAX_REQUEST_ROWS = 512

pytestmark = pytest.mark.skipif(
    engine.find_library() is None,
    reason="libdetlogp_client.so not built (bazel build //client/capi:libdetlogp_client.so)",
)


@pytest.fixture(scope="module")
def shm_server(server_binary):
    if "allow_shared_memory" not in server_flags(str(server_binary)):
        pytest.fail(f"{server_binary} has no --allow_shared_memory: rebuild it", pytrace=False)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="detlogp-shm-"))
    model = TestModel(folder, hidden=96, vocab=500, padded_vocab=512, seed=21)
    socket = folder / "detlogp.sock"
    flags = model.flags + [
        f"--max_request_rows={MAX_REQUEST_ROWS}",
        f"--unix_socket={socket}",
        "--device=cpu",  # on GPU hosts too: CUDA regions are refused here
        "--cpu_threads=1",
    ]
    with LocalServer(server_binary, flags) as server:
        server.model = model
        server.unix_target = f"unix:{socket}"
        yield server


@pytest.fixture(scope="module")
def idle_server(server_binary, shm_server):
    """shm_server's model, regions released after IDLE_S idle seconds."""
    model = shm_server.model
    flags = model.flags + [f"--shared_memory_idle_s={IDLE_S}", "--device=cpu", "--cpu_threads=1"]
    with LocalServer(server_binary, flags) as server:
        server.model = model
        yield server


def regions(target, kind="System"):
    """The server's regions of `kind` (System or Cuda), by name."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SharedMemoryServiceStub(channel)
        request = getattr(pb, f"{kind}SharedMemoryStatusRequest")()
        answer = getattr(stub, f"{kind}SharedMemoryStatus")(request, timeout=10)
    return {region.name: region for region in answer.regions}


def shm_files(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"detlogp_{pid}_")]


def assert_path(result, path):
    assert (result.engine, result.path) == ("native", path), result
    assert result.timings is None or result.timings.path == path, result.timings


def same_bits(result, want):
    for name in FIELDS:
        values = getattr(want, name)
        if values is None:
            assert getattr(result, name) is None, name
        else:
            assert getattr(result, name).tobytes() == values.tobytes(), name


def rows(model, n, seed, dtype="float32"):
    hidden, targets = model.random_rows(n, seed)
    if dtype == "bf16":
        hidden = tensors.float32_to_bf16_bits(hidden)
    return hidden, targets


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
@pytest.mark.parametrize("n", [1, 300, 5 * MAX_REQUEST_ROWS + 3])
def test_system_region_gives_the_bits_of_grpc_bytes(shm_server, dtype, n):
    model = shm_server.model
    hidden, targets = rows(model, n, seed=400 + n, dtype=dtype)
    with detlogp.Client(shm_server.target, timeout=60, shared_memory="off") as plain:
        want = plain.logprobs(hidden, targets, timing=True, **EXTRAS)
        assert want.path == "grpc"
    every_call = detlogp.TransferOptions(shared_memory_min_bytes=0)
    with detlogp.Client(shm_server.target, timeout=60, transfer_options=every_call) as client:
        got = client.logprobs(hidden, targets, timing=True, **EXTRAS)
        assert_path(got, "system_shm")
        assert got.timings.slices == -(-n // MAX_REQUEST_ROWS)
        assert got.timings.server_reported and got.timings.compute_s > 0
        print(f"{n} rows: {got.timings}")
    same_bits(got, want)


def test_region_piece_bytes_sets_how_a_call_is_written_into_the_region(shm_server):
    # 2,000 bf16 rows of 192 bytes: pieces of at least 100 rows make 8 (at
    # most 8 pieces: 250 rows each); the default (8 MiB) leaves the server's
    # request limit to cut them, 4 requests.
    model = shm_server.model
    hidden, targets = rows(model, 2000, seed=470, dtype="bf16")
    with detlogp.Client(shm_server.target, timeout=60, shared_memory="off") as plain:
        want = plain.logprobs(hidden, targets, **EXTRAS)
    for piece_bytes, slices in ((100 * 192, 8), (8 << 20, 4)):
        options = detlogp.TransferOptions(shared_memory_min_bytes=0, region_piece_bytes=piece_bytes)
        with detlogp.Client(shm_server.target, timeout=60, transfer_options=options) as client:
            got = client.logprobs(hidden, targets, timing=True, **EXTRAS)
        assert_path(got, "system_shm")
        assert got.timings.slices == slices, (piece_bytes, got.timings)
        same_bits(got, want)
    with pytest.raises(ValueError, match="TransferOptions.region_piece_bytes"):
        detlogp.TransferOptions(region_piece_bytes=0).validated()


def test_the_unix_socket_and_a_system_region_give_the_same_bits(shm_server):
    model = shm_server.model
    hidden, targets = rows(model, 2000, seed=410, dtype="bf16")
    with detlogp.Client(shm_server.target, timeout=60, shared_memory="off") as plain:
        want = plain.logprobs(hidden, targets, **EXTRAS)
    with detlogp.Client(shm_server.unix_target, timeout=60) as client:
        got = client.logprobs(hidden, targets, timing=True, **EXTRAS)
        assert_path(got, "system_shm")
    same_bits(got, want)


def test_a_region_is_registered_once_and_reused(shm_server):
    model = shm_server.model
    pid = os.getpid()
    with detlogp.Client(shm_server.target, timeout=60) as client:
        for seed in range(5):
            hidden, targets = rows(model, 200, seed=420 + seed)
            assert_path(client.logprobs(hidden, targets), "system_shm")
        mine = {
            k: v for k, v in regions(shm_server.target).items() if k.startswith(f"detlogp_{pid}_")
        }
        assert len(mine) == 1, sorted(mine)
        (region,) = mine.values()
        assert region.use.requests >= 5
        assert region.use.requests_in_flight == 0
        # The server holds its own mapping: the name is gone already.
        assert shm_files(pid) == []
    left = [k for k in regions(shm_server.target) if k.startswith(f"detlogp_{pid}_")]
    assert left == []  # close() unregistered it


def test_calls_at_once_never_share_a_region(shm_server):
    """More calls at once than the engine keeps regions (4): they wait for
    each other's, and each answer has its own rows' bits."""
    model = shm_server.model
    inputs = [rows(model, 700 + 10 * i, seed=430 + i, dtype="bf16") for i in range(8)]
    with detlogp.Client(shm_server.target, timeout=60, shared_memory="off") as plain:
        wants = [plain.logprobs(h, t, **EXTRAS) for h, t in inputs]
    with detlogp.Client(shm_server.target, timeout=60) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in range(3):
                gots = list(pool.map(lambda hw: client.logprobs(*hw, **EXTRAS), inputs))
                for got, want in zip(gots, wants):
                    assert_path(got, "system_shm")
                    same_bits(got, want)


def test_a_server_without_shared_memory_gets_bytes_and_the_reason_once(
    server_binary, caplog, tmp_path
):
    model = TestModel(tmp_path, hidden=32, vocab=100, padded_vocab=128)
    flags = model.flags + ["--device=cpu", "--allow_shared_memory=false", "--cpu_threads=1"]
    hidden, targets = model.random_rows(1000, seed=440)
    with LocalServer(server_binary, flags) as server:
        with detlogp.Client(server.target, timeout=30, shared_memory="off") as plain:
            want = plain.logprobs(hidden, targets, **EXTRAS)
        with caplog.at_level(logging.WARNING, logger="detlogp"):
            with detlogp.Client(server.target, timeout=30) as client:
                for _ in range(3):
                    got = client.logprobs(hidden, targets, timing=True, **EXTRAS)
                    assert_path(got, "grpc")
                    assert got.path_refused == "system_shm"
                    same_bits(got, want)
    said = [r.getMessage() for r in caplog.records if r.name == "detlogp"]
    assert len(said) == 1, said
    assert "shared memory" in said[0] and "system: " in said[0]
    print(said[0])


def test_shared_memory_off_is_off(shm_server):
    model = shm_server.model
    hidden, targets = rows(model, 100, seed=450)
    pid = os.getpid()
    with detlogp.Client(shm_server.target, timeout=30, shared_memory="off") as client:
        small = client.logprobs(hidden, targets, timing=True)
        assert (small.engine, small.path) == ("python", "grpc")
        large = client.logprobs(*rows(model, 3 * MAX_REQUEST_ROWS, seed=451), timing=True)
        assert_path(large, "grpc")
        assert not [k for k in regions(shm_server.target) if k.startswith(f"detlogp_{pid}_")]


def test_a_region_its_owner_truncated_fails_only_its_requests(shm_server):
    """An owner that shrinks its registered object (ftruncate) gets
    FAILED_PRECONDITION naming hidden.shared_memory for requests that name the
    region, fp32 and bf16 rows alike; the server goes on answering everyone
    else with the same bits."""
    from multiprocessing import shared_memory

    model = shm_server.model
    fp32, targets = rows(model, 40, seed=460)
    bf16 = tensors.float32_to_bf16_bits(fp32)
    with detlogp.Client(shm_server.target, timeout=60, shared_memory="off") as plain:
        want = plain.logprobs(fp32, targets, **EXTRAS)
    block = shared_memory.SharedMemory(create=True, size=1 << 20)
    placed = {
        pb.DTYPE_FLOAT32: (fp32.tobytes(), 64 << 10),
        pb.DTYPE_BFLOAT16: (bf16.tobytes(), 512 << 10),
    }
    try:
        for data, offset in placed.values():
            block.buf[offset : offset + len(data)] = data
        with grpc.insecure_channel(shm_server.target) as channel:
            regions_stub = pb_grpc.SharedMemoryServiceStub(channel)
            regions_stub.SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(
                    name="shrinking", key=f"/{block.name}", byte_size=1 << 20
                ),
                timeout=10,
            )
            logprobs = pb_grpc.LogProbServiceStub(channel)
            requests = [
                pb.LogProbRequest(
                    hidden=pb.Tensor(
                        dtype=dtype,
                        shape=[len(targets), model.hidden],
                        shared_memory=pb.SharedMemoryRef(
                            region="shrinking", offset=offset, byte_size=len(data)
                        ),
                    ),
                    target_ids=targets.tolist(),
                )
                for dtype, (data, offset) in placed.items()
            ]
            for request in requests:
                assert len(logprobs.ComputeLogProbs(request, timeout=30).logprobs) == len(targets)
            descriptor = os.open(f"/dev/shm/{block.name}", os.O_RDWR)
            os.ftruncate(descriptor, 4096)
            os.close(descriptor)
            for request in requests:
                with pytest.raises(grpc.RpcError) as refused:
                    logprobs.ComputeLogProbs(request, timeout=30)
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert refused.value.details().startswith(
                    'hidden.shared_memory: region "shrinking" shrank'
                )
            with detlogp.Client(shm_server.target, timeout=60) as client:
                same_bits(client.logprobs(fp32, targets, **EXTRAS), want)
            regions_stub.SystemSharedMemoryUnregister(
                pb.SystemSharedMemoryUnregisterRequest(name="shrinking"), timeout=10
            )
    finally:
        block.close()
        block.unlink()


KILLED_CLIENT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import detlogp

    target, hidden_size = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((4000, hidden_size)).astype(np.float32)
    targets = rng.integers(0, 100, 4000)
    client = detlogp.Client(target, timeout=60)
    client.logprobs(hidden, targets)
    print("registered", flush=True)
    while True:
        client.logprobs(hidden, targets)
    """
)


def test_a_client_killed_mid_call_leaks_nothing(idle_server):
    shm_server = idle_server
    model = shm_server.model
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, shm_server.target, str(model.hidden)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "registered"
        theirs = lambda: [
            k for k in regions(shm_server.target) if k.startswith(f"detlogp_{child.pid}_")
        ]  # noqa: E731
        assert theirs(), "the child registered no region"
        time.sleep(0.3)  # well inside a call
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert shm_files(child.pid) == []
        deadline = time.monotonic() + IDLE_S + 10
        while theirs() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert theirs() == [], "the server did not release the killed client's regions"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    # The server still serves shared-memory callers.
    hidden, targets = rows(model, 1000, seed=460)
    with detlogp.Client(shm_server.target, timeout=30) as client:
        assert_path(client.logprobs(hidden, targets, timing=True), "system_shm")


def test_a_region_the_server_released_is_replaced(idle_server):
    """After --shared_memory_idle_s without calls the server forgets the
    client's region; the next call registers a new one, same bits."""
    shm_server = idle_server
    model = shm_server.model
    hidden, targets = rows(model, 300, seed=470)
    pid = os.getpid()
    with detlogp.Client(shm_server.target, timeout=60) as client:
        first = client.logprobs(hidden, targets, **EXTRAS)
        before = {k for k in regions(shm_server.target) if k.startswith(f"detlogp_{pid}_")}
        deadline = time.monotonic() + IDLE_S + 10
        while time.monotonic() < deadline and before & set(regions(shm_server.target)):
            time.sleep(0.2)
        again = client.logprobs(hidden, targets, timing=True, **EXTRAS)
        assert_path(again, "system_shm")
        after = {k for k in regions(shm_server.target) if k.startswith(f"detlogp_{pid}_")}
        assert after and not after & before
    same_bits(again, first)


def test_async_client_uses_a_system_region_and_unregisters_on_close(shm_server):
    model = shm_server.model
    hidden, targets = rows(model, 3 * MAX_REQUEST_ROWS, seed=480, dtype="bf16")
    with detlogp.Client(shm_server.target, timeout=60, shared_memory="off") as plain:
        want = plain.logprobs(hidden, targets, **EXTRAS)
    pid = os.getpid()

    async def main():
        async with AsyncClient(shm_server.target, timeout=60) as aclient:
            results = await asyncio.gather(
                *[aclient.logprobs(hidden, targets, timing=True, **EXTRAS) for _ in range(4)]
            )
            held = [k for k in regions(shm_server.target) if k.startswith(f"detlogp_{pid}_")]
        return results, held

    results, held = asyncio.run(main())
    assert held
    for result in results:
        assert_path(result, "system_shm")
        same_bits(result, want)
    assert not [k for k in regions(shm_server.target) if k.startswith(f"detlogp_{pid}_")]


UNCLOSED_CLIENTS = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    import detlogp
    from detlogp.aio import AsyncClient

    target, hidden_size = sys.argv[1], int(sys.argv[2])
    hidden = np.ones((1000, hidden_size), np.float32)
    targets = np.zeros(1000, np.int64)
    sync_client = detlogp.Client(target, timeout=60)
    print(sync_client.logprobs(hidden, targets, timing=True).timings.path)

    async def main():
        aclient = AsyncClient(target, timeout=60)
        print((await aclient.logprobs(hidden, targets, timing=True)).timings.path)
        return aclient

    kept = asyncio.run(main())
    print("exiting", flush=True)
    """
)


def test_clients_never_closed_release_their_regions_at_exit(shm_server):
    """A sync and an asyncio client left open: their regions are
    unregistered when the process exits (this server keeps idle regions
    for 300 s, so only that removes them)."""
    model = shm_server.model
    child = subprocess.Popen(
        [sys.executable, "-c", UNCLOSED_CLIENTS, shm_server.target, str(model.hidden)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.split() == ["system_shm", "system_shm", "exiting"], out
    prefix = f"detlogp_{child.pid}_"
    log = shm_server.log()
    registered = {
        line.split("system region ")[1].split()[0]
        for line in log.splitlines()
        if prefix in line and line.rstrip().endswith(")") and "registered (" in line
    }
    assert len(registered) == 2, registered
    assert not [name for name in regions(shm_server.target) if name.startswith(prefix)]
    assert shm_files(child.pid) == []


def test_cpu_torch_tensors_use_a_system_region(shm_server):
    torch = pytest.importorskip("torch")
    model = shm_server.model
    hidden, targets = rows(model, 700, seed=490)
    with detlogp.Client(shm_server.target, timeout=60, shared_memory="off") as plain:
        want = plain.logprobs(torch.from_numpy(hidden).to(torch.bfloat16), targets, **EXTRAS)
    with detlogp.Client(shm_server.target, timeout=60) as client:
        got = client.logprobs(
            torch.from_numpy(hidden).to(torch.bfloat16), targets, timing=True, **EXTRAS
        )
        assert_path(got, "system_shm")
    same_bits(got, want)


def cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


@pytest.fixture(scope="module")
def cuda_server(server_binary):
    """A server computing on the GPU (cuda:0), with a Unix socket."""
    cuda_or_skip()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="detlogp-cuda-shm-"))
    model = TestModel(folder, hidden=256, vocab=1000, padded_vocab=1024, seed=23)
    socket = folder / "detlogp.sock"
    flags = model.flags + ["--device=cuda:0", f"--unix_socket={socket}", "--max_request_rows=4096"]
    with LocalServer(server_binary, flags) as server:
        server.model = model
        server.unix_target = f"unix:{socket}"
        yield server


@pytest.mark.parametrize("n", [1, 3000, 20000])
def test_cuda_region_gives_the_bits_of_grpc_bytes(cuda_server, n):
    torch = cuda_or_skip()
    model = cuda_server.model
    hidden, targets = rows(model, n, seed=500 + n)
    on_gpu = torch.from_numpy(hidden).to("cuda:0", torch.bfloat16)
    with detlogp.Client(cuda_server.target, timeout=60, shared_memory="off") as plain:
        want = plain.logprobs(on_gpu, targets, timing=True, **EXTRAS)
    every_call = detlogp.TransferOptions(shared_memory_min_bytes=0)
    with detlogp.Client(cuda_server.unix_target, timeout=60, transfer_options=every_call) as client:
        got = client.logprobs(on_gpu, targets, timing=True, **EXTRAS)
        assert_path(got, "cuda_shm")
        assert regions(cuda_server.target, "Cuda")
        system = detlogp.TransferOptions(shared_memory="system", shared_memory_min_bytes=0)
        with detlogp.Client(cuda_server.target, timeout=60, transfer_options=system) as sys_client:
            through_host = sys_client.logprobs(on_gpu, targets, timing=True, **EXTRAS)
            assert_path(through_host, "system_shm")
    same_bits(got, want)
    same_bits(through_host, want)
    assert not regions(cuda_server.target, "Cuda")


def test_large_cuda_calls_at_once_give_the_bits_of_one_at_a_time(cuda_server):
    """Calls at once through the engine's CUDA region take turns for it;
    every answer has the bits of the same call alone."""
    import concurrent.futures

    torch = cuda_or_skip()
    model = cuda_server.model
    n = (8 << 20) // (model.hidden * 2) + 11
    calls = []
    for seed in range(4):
        hidden, targets = rows(model, n, seed=530 + seed)
        calls.append((torch.from_numpy(hidden).to("cuda:0", torch.bfloat16), targets))
    with detlogp.Client(cuda_server.unix_target, timeout=60) as client:
        alone = [client.logprobs(h, t, **EXTRAS) for h, t in calls]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(
                pool.map(lambda c: client.logprobs(c[0], c[1], timing=True, **EXTRAS), calls)
            )
    for got, want in zip(together, alone):
        assert_path(got, "cuda_shm")
        same_bits(got, want)


def test_a_cpu_server_refuses_cuda_regions_and_the_rows_take_a_system_one(shm_server, caplog):
    """The CPU server refuses the engine's CUDA region: the rows are copied
    to the host and go through its system region, the refusal logged once
    and the path saying so."""
    torch = cuda_or_skip()
    model = shm_server.model
    hidden, targets = rows(model, 1000, seed=510)
    on_gpu = torch.from_numpy(hidden).to("cuda:0", torch.bfloat16)
    with detlogp.Client(shm_server.target, timeout=60, shared_memory="off") as plain:
        want = plain.logprobs(on_gpu, targets, **EXTRAS)
    with caplog.at_level(logging.WARNING, logger="detlogp"):
        with detlogp.Client(shm_server.target, timeout=60) as client:
            results = [client.logprobs(on_gpu, targets, timing=True, **EXTRAS) for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if r.name == "detlogp"]
    assert len(said) == 1 and "cuda: " in said[0], said
    for result in results:
        assert_path(result, "system_shm")
        assert result.path_refused == "cuda_shm"
        same_bits(result, want)
