"""Closing a client is quick: the C++ client library keeps gRPC initialised
for the process, so closing the last client does not wait out gRPC's
shutdown (about ten seconds, during which close() and the process's exit
used to hang)."""

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
