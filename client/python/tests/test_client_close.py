"""A client's lifetime. Closing is quick: the C++ client library keeps gRPC
initialised for the process, so closing the last client does not wait out
gRPC's shutdown (about ten seconds, during which close() and the process's
exit used to hang). In a child forked after the library started gRPC's
threads, engine calls fail at once, naming the cause, instead of waiting
forever; calls of one request still work, and the child exits."""

import subprocess
import sys
import textwrap
import time

import pytest
from detlogp import engine
from detlogp.testing import LocalServer, TestModel

pytestmark = pytest.mark.skipif(
    engine.find_library() is None,
    reason="libdetlogp_client.so not built (bazel build //client/capi:libdetlogp_client.so)",
)

# In a process of its own: the close must drop the process's last gRPC
# object for the stall to show.
SCRIPT = textwrap.dedent(
    """
    import sys, time
    import detlogp, numpy as np
    target, hidden, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    n = (64 << 20) // (4 * hidden)  # 64 MiB of rows, spread over connections
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((n, hidden)).astype(np.float32)
    targets = rng.integers(0, vocab, size=n)
    client = detlogp.Client(target, timeout=60, shared_memory="off")
    result = client.logprobs(rows, targets)
    began = time.perf_counter()
    client.close()
    print(result.engine, time.perf_counter() - began)
    """
)


def test_closing_the_last_client_returns_at_once(server_binary, tmp_path):
    # Wide rows (a call long enough for gRPC to arm its timers); a tiny
    # vocabulary keeps the CPU's work small.
    model = TestModel(tmp_path, hidden=1024, vocab=8, padded_vocab=8)
    with LocalServer(server_binary, model.flags) as server:
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, server.target, str(model.hidden), str(model.vocab)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - began
    assert done.returncode == 0, done.stderr
    used_engine, close_seconds = done.stdout.split()
    assert used_engine == "native", done.stdout  # the C++ client carried the call
    assert float(close_seconds) < 2.0, f"close() took {close_seconds} s"
    assert elapsed < 30.0, f"the process took {elapsed:.1f} s"


FORK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import detlogp, numpy as np
    target, hidden, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = np.random.default_rng(6)
    large = rng.standard_normal((70000, hidden)).astype(np.float32)  # > one request
    large_targets = rng.integers(0, vocab, size=len(large))
    client = detlogp.Client(target, timeout=20, shared_memory="off")
    want = client.logprobs(large[:8], large_targets[:8]).logprobs
    assert client.logprobs(large, large_targets).engine == "native"
    pid = os.fork()
    if pid == 0:
        began = time.monotonic()
        try:
            client.logprobs(large, large_targets)
            print("inherited-large-call-answered")
        except detlogp.FailedPrecondition as error:
            assert "fork" in str(error), error
            print("inherited-refused")
        with detlogp.Client(target, timeout=20) as fresh:
            small = fresh.logprobs(large[:8], large_targets[:8]).logprobs
            assert np.array_equal(small.view(np.uint32), want.view(np.uint32))
            try:
                fresh.logprobs(large, large_targets)
                print("fresh-large-call-answered")
            except detlogp.EngineRequired as error:
                assert "fork" in str(error), error
                print("fresh-refused")
        print(f"child-seconds {time.monotonic() - began:.2f}", flush=True)
        sys.exit(0)  # through the finalizers, which must not wait on the engine
    _, status = os.waitpid(pid, 0)
    print("child-exit", os.waitstatus_to_exitcode(status))
    assert client.logprobs(large, large_targets).engine == "native"
    print("parent-still-served")
    """
)


def test_a_forked_child_is_refused_at_once_and_exits(server_binary, tmp_path):
    model = TestModel(tmp_path, hidden=16, vocab=8, padded_vocab=8)
    with LocalServer(server_binary, model.flags) as server:
        done = subprocess.run(
            [sys.executable, "-c", FORK_SCRIPT, server.target, str(model.hidden), str(model.vocab)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert "inherited-refused" in lines, done.stdout
    assert "fresh-refused" in lines, done.stdout
    assert "child-exit 0" in lines, done.stdout
    assert "parent-still-served" in lines, done.stdout
    child_seconds = float(next(x for x in lines if x.startswith("child-seconds")).split()[1])
    assert child_seconds < 10.0, done.stdout
