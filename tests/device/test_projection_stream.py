"""projection_stream: one H3 video (364,608 rows, 7.8 GB of Y) streamed
from a server on cuda:0 by detlogp_cli project at each rows_per_chunk, one
and four calls, in rounds (ascending in odd rounds, descending in even
ones, after an untimed warm-up round); four videos at once with the
server's peak RSS; then the transport-only bench (an instant backend).
GB/s is Y's bytes over the CLI process's wall time. Knobs:
DETLOGP_STREAM_CHUNKS ("256 512 1024 2048"; "512:u" connects over the Unix
socket), DETLOGP_STREAM_ROWS (364608), DETLOGP_STREAM_REPEATS (1),
DETLOGP_STREAM_CALLS ("1 4"), DETLOGP_STREAM_FOUR_VIDEOS=0,
DETLOGP_STREAM_TRANSPORT_BENCH=0, DETLOGP_STREAM_SERVER_ARGS."""

import os
import statistics
import subprocess
import threading
import time

import pytest
from storms import process_memory_kib

pytestmark = pytest.mark.projection_stream

ROWS = int(os.environ.get("DETLOGP_STREAM_ROWS", "364608"))
CHUNKS = os.environ.get("DETLOGP_STREAM_CHUNKS", "256 512 1024 2048").split()
REPEATS = int(os.environ.get("DETLOGP_STREAM_REPEATS", "1"))
CALLS = [int(c) for c in os.environ.get("DETLOGP_STREAM_CALLS", "1 4").split()]
FOUR_CHUNK = 512
Y_BYTES_PER_ROW = 5376 * 4


@pytest.fixture(scope="module")
def stream_server(serving, tmp_path_factory):
    socket = tmp_path_factory.mktemp("stream") / "detlogp.sock"
    extra = os.environ.get("DETLOGP_STREAM_SERVER_ARGS", "").split()
    with serving("stream", "--device=cuda:0", f"--unix_socket={socket}", *extra) as server:
        yield server, socket


def project(bundle, target, chunk, *args, log=None):
    """Wall seconds of one detlogp_cli project (tuned for large messages)."""
    start = time.perf_counter()
    done = subprocess.run(
        [
            str(bundle.cli),
            "project",
            "--project_malloc_tuning",
            f"--target={target}",
            f"--project_rows={ROWS}",
            f"--rows_per_chunk={chunk}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - start
    if log is not None:
        log.write(done.stdout + done.stderr)
    assert done.returncode == 0, f"project rows_per_chunk={chunk} {args}: {done.stderr[-2000:]}"
    return seconds


def test_one_video_at_each_chunk_size(bundle, stream_server, out, run, figures):
    server, socket = stream_server
    speeds = {}
    with open(out / "stream.log", "w") as log:
        project(bundle, server.target, 512, "--nohash_y", "--seed=1", log=log)
        for rep in range(0, REPEATS + 1):  # round 0: untimed warm-up
            order = CHUNKS if rep % 2 else list(reversed(CHUNKS))
            for setting in order:
                chunk, _, suffix = setting.partition(":")
                target = f"unix:{socket}" if "u" in suffix else server.target
                for calls in CALLS:
                    seconds = project(
                        bundle,
                        target,
                        chunk,
                        f"--project_streams={calls}",
                        "--seed=7",
                        "--nohash_y",
                        log=log,
                    )
                    if rep > 0:
                        speeds.setdefault(f"{setting} x{calls}", []).append(
                            ROWS * Y_BYTES_PER_ROW / seconds / 1e9
                        )
    figures["gb_per_s_median"] = {k: statistics.median(v) for k, v in speeds.items()}
    print(figures["gb_per_s_median"])
    # Each pair of settings compared round by round (paired ratios, sign test).
    for calls in CALLS:
        for position, setting in enumerate(CHUNKS):
            values = speeds[f"{setting} x{calls}"]
            (out / f"speed_{position}_{calls}.txt").write_text("".join(f"{v}\n" for v in values))
        run(
            f"summary_x{calls}",
            [
                "python3",
                bundle.script("projection_stream_summary.py"),
                f"--calls={calls}",
                f"--chunks={' '.join(CHUNKS)}",
                out / f"speed_%d_{calls}.txt",
            ],
            timeout_s=60,
        )


@pytest.mark.skipif(
    os.environ.get("DETLOGP_STREAM_FOUR_VIDEOS") == "0", reason="DETLOGP_STREAM_FOUR_VIDEOS=0"
)
@pytest.mark.parametrize(
    "hash_flag, calls", [("--nohash_y", 1), ("--hash_y", 1), ("--nohash_y", 4)]
)
def test_four_videos_at_once(bundle, stream_server, figures, hash_flag, calls):
    server, _ = stream_server
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process_memory_kib(server.pid)["VmRSS"])
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    results, errors = [], []

    def one(seed):
        try:
            results.append(
                project(
                    bundle,
                    server.target,
                    FOUR_CHUNK,
                    f"--project_streams={calls}",
                    f"--seed={seed}",
                    hash_flag,
                )
            )
        except AssertionError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    sampler.join()
    assert not errors, errors
    slowest = max(results)
    figures[f"four videos {hash_flag} x{calls}"] = {
        "slowest_s": slowest,
        "total_gb_per_s": 4 * ROWS * Y_BYTES_PER_ROW / slowest / 1e9,
        "server_peak_rss_mib": peak[0] / 1024,
    }


@pytest.mark.skipif(
    os.environ.get("DETLOGP_STREAM_TRANSPORT_BENCH") == "0",
    reason="DETLOGP_STREAM_TRANSPORT_BENCH=0",
)
def test_transport_only(bundle, run):
    for chunk in sorted({int(c.partition(":")[0]) for c in CHUNKS}):
        for calls in (1, 2, 4):
            run(
                f"transport_{chunk}_x{calls}",
                [
                    bundle.bin("projection_stream"),
                    "--reader=client",
                    f"--rows={ROWS}",
                    f"--chunks={chunk}",
                    "--streams=0",
                    "--repeats=3",
                    f"--client_streams={calls}",
                ],
                timeout_s=600,
            )
    run(
        "transport_four",
        [
            bundle.bin("projection_stream"),
            "--reader=client",
            f"--rows={ROWS}",
            "--chunks=",
            "--streams=4",
            "--concurrent_chunks=2048",
            "--repeats=3",
        ],
        timeout_s=600,
    )
