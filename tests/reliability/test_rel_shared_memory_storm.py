"""9) Shared-memory storm: Python clients that put their rows in system
shared memory are killed with SIGKILL at random moments (mid-call) and
replaced, while in-process shared-memory callers, some with deadlines of a
few milliseconds, check every answer against the solo bits. Holds: the
server keeps serving with solo bits, nothing of a killed client is left in
/dev/shm, the server releases every killed client's region after
--shared_memory_idle_s, and its RSS comes back within 10% of the warm-up's."""

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter

import detlogp
import grpc
import numpy as np
from detlogp.loadgen import RowPool
from detlogp.testing import LocalServer
from detlogp.v1 import detlogp_pb2 as pb
from detlogp.v1 import detlogp_pb2_grpc as pb_grpc

PHASE_S = float(os.environ.get("DETLOGP_SHM_STORM_S", "12"))
IDLE_S = 2
MAX_REQUEST_ROWS = 256
CALLERS = 6
DYING_CALLERS = 3
EVERY_CALL = detlogp.TransferOptions(shared_memory_min_bytes=0)

DYING_CALLER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import detlogp

    target, pool_file, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pool = np.load(pool_file)
    hidden, targets = pool["hidden"], pool["targets"]
    rng = np.random.default_rng(seed)
    options = detlogp.TransferOptions(shared_memory_min_bytes=0)
    client = detlogp.Client(target, timeout=60, transfer_options=options)
    first = True
    while True:
        rows = rng.integers(0, len(targets), int(rng.integers(1, 1500)))
        result = client.logprobs(hidden[rows], targets[rows], timing=True)
        if first:
            print(result.timings.path, flush=True)
            first = False
    """
)


def system_regions(target):
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SharedMemoryServiceStub(channel)
        answer = stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=10)
    return [region.name for region in answer.regions]


def shm_files(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"detlogp_{pid}_")]


def callers(target, pool, seconds, seed, deadline_fraction):
    """CALLERS threads of shared-memory calls (1..1500 rows from the pool);
    `deadline_fraction` of them with a 1-20 ms deadline. Outcome counts."""
    counts = Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def caller(index):
        rng = random.Random(seed * 100 + index)
        with detlogp.Client(target, timeout=60, transfer_options=EVERY_CALL) as client:
            while time.monotonic() < end:
                rows = np.array(
                    [rng.randrange(len(pool.targets)) for _ in range(rng.randint(1, 1500))]
                )
                short = rng.random() < deadline_fraction
                try:
                    result = client.logprobs(
                        pool.hidden[rows],
                        pool.targets[rows],
                        timeout=rng.uniform(0.001, 0.02) if short else 60,
                        timing=True,
                    )
                except detlogp.DeadlineExceeded:
                    with lock:
                        counts["deadline_exceeded"] += 1
                    continue
                except detlogp.DetlogpError as error:
                    with lock:
                        counts[f"error_{type(error).__name__}"] += 1
                    continue
                mismatched = int(
                    np.sum(result.logprobs.view(np.uint32) != pool.solo_logp[rows].view(np.uint32))
                )
                with lock:
                    counts["ok"] += 1
                    counts[f"path_{result.timings.path}"] += 1
                    counts["rows_checked"] += len(rows)
                    counts["rows_mismatched"] += mismatched

    with concurrent.futures.ThreadPoolExecutor(CALLERS) as threads:
        list(threads.map(caller, range(CALLERS)))
    return counts


def dying_callers(target, pool_file, seconds, seed):
    """DYING_CALLERS processes at a time, each killed with SIGKILL 0.2-1.5 s
    after its first answer (mid-call: they call without pause) and
    replaced. Returns the pids killed and the path each reported."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    killed, paths = [], Counter()

    def one(slot):
        while time.monotonic() < end:
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    DYING_CALLER,
                    target,
                    pool_file,
                    str(rng.randrange(1 << 30)),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                paths[child.stdout.readline().strip() or "none"] += 1
                time.sleep(rng.uniform(0.2, 1.5))
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait(30)
                killed.append(child.pid)

    with concurrent.futures.ThreadPoolExecutor(DYING_CALLERS) as threads:
        list(threads.map(one, range(DYING_CALLERS)))
    return killed, paths


def test_shared_memory_callers_killed_mid_call_leak_nothing(server_binary, model, report):
    flags = model.flags + [
        "--cpu_threads=1",
        f"--max_request_rows={MAX_REQUEST_ROWS}",
        f"--shared_memory_idle_s={IDLE_S}",
    ]
    with LocalServer(server_binary, flags) as server, tempfile.TemporaryDirectory() as folder:
        pool = RowPool.random(model.hidden, model.vocab, rows=64, seed=9)
        pool.score_solo(server.target)
        pool_file = os.path.join(folder, "pool.npz")
        np.savez(pool_file, hidden=pool.hidden, targets=pool.targets)

        warm = callers(server.target, pool, 2.0, seed=1, deadline_fraction=0.0)
        time.sleep(IDLE_S + 2)  # the warm-up's regions are unregistered; settle
        rss_before = server.rss_kib()

        with concurrent.futures.ThreadPoolExecutor(1) as background:
            dying = background.submit(dying_callers, server.target, pool_file, PHASE_S, seed=2)
            storm = callers(server.target, pool, PHASE_S, seed=3, deadline_fraction=0.3)
            killed, child_paths = dying.result()
        assert server.running(), f"server died in the storm; log tail:\n{server.log()[-1500:]}"
        leaked_files = {pid: shm_files(pid) for pid in killed if shm_files(pid)}

        def theirs():
            prefixes = tuple(f"detlogp_{pid}_" for pid in killed)
            return [name for name in system_regions(server.target) if name.startswith(prefixes)]

        held_after_kills = len(theirs())
        release_by = time.monotonic() + IDLE_S + 10
        while theirs() and time.monotonic() < release_by:
            time.sleep(0.2)
        left = system_regions(server.target)
        time.sleep(1.0)
        rss_after = server.rss_kib()
        after = callers(server.target, pool, 2.0, seed=4, deadline_fraction=0.0)
        assert server.terminate() == 0

    report(
        f"tried: {PHASE_S:.0f}s of {CALLERS} shared-memory callers (30% with 1-20 ms "
        f"deadlines) beside {DYING_CALLERS} processes at a time killed with -9 mid-call: "
        f"{len(killed)} killed (their first paths: {dict(child_paths)})"
    )
    report(f"storm outcomes: {dict(sorted(storm.items()))}")
    report(
        f"held: regions of killed clients right after the storm {held_after_kills}, "
        f"after the idle release {len(left)}; /dev/shm leftovers {leaked_files}; "
        f"RSS warm {rss_before} KiB, after {rss_after} KiB "
        f"({100.0 * (rss_after - rss_before) / rss_before:+.1f}%); after-storm "
        f"{dict(sorted(after.items()))}"
    )
    assert len(killed) >= DYING_CALLERS and child_paths.get("system_shm", 0) >= 1
    assert not leaked_files
    assert left == [], left
    assert warm["path_system_shm"] == warm["ok"] > 0
    assert storm["ok"] > 0 and storm["path_system_shm"] > 0
    assert set(storm) <= {
        "ok",
        "deadline_exceeded",
        "path_system_shm",
        "rows_checked",
        "rows_mismatched",
    }, storm
    assert storm["rows_mismatched"] == 0 and warm["rows_mismatched"] == 0
    assert after["ok"] > 0 and after["rows_mismatched"] == 0
    assert abs(rss_after - rss_before) <= 0.10 * rss_before
