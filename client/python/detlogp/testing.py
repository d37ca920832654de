"""Runs a real detlogp_server on a loopback port, for tests and tools.

    with LocalServer(binary, ["--weights", path]) as server:
        client = detlogp.Client(server.target)
        ...
    server.returncode, server.stop_counts()

Nothing is built here: `binary` must exist (bazel build //server:detlogp_server).
"""

import functools
import os
import pathlib
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

_STOPPED = re.compile(
    r"stopped: (\d+) batches, (\d+) rows computed, (\d+) expired, "
    r"(\d+) cancelled, (\d+) rejected"
)


def find_server_binary(start=None):
    """$DETLOGP_SERVER, else bazel-bin/server/detlogp_server in `start` (or
    the working directory) or any folder above it; None if not found."""
    env = os.environ.get("DETLOGP_SERVER")
    if env:
        return pathlib.Path(env)
    here = pathlib.Path(start or os.getcwd()).resolve()
    for folder in [here, *here.parents]:
        candidate = folder / "bazel-bin" / "server" / "detlogp_server"
        if candidate.exists():
            return candidate
    return None


def server_binary_for_tests(repo_root):
    """find_server_binary(repo_root) for pytest fixtures: fails the test run
    with how to build it when there is none."""
    import pytest  # only tests call this

    binary = find_server_binary(repo_root)
    if binary is None or not binary.exists():
        pytest.fail(
            "no server binary: run `bazel build //server:detlogp_server` "
            f"in {repo_root} (or set DETLOGP_SERVER)",
            pytrace=False,
        )
    return binary


@functools.cache
def server_flags(binary):
    """Flag names the binary knows (from --helpfull)."""
    out = subprocess.run([str(binary), "--helpfull"], capture_output=True, text=True, timeout=30)
    return frozenset(re.findall(r"--([a-z_0-9]+) ", out.stdout + out.stderr))


def raw_logprob_methods(channel):
    """(ComputeLogProbs, StreamLogProbs) on `channel` sending and returning
    bytes as they are: for tests that send what no client would."""
    identity = lambda data: data  # noqa: E731
    unary = channel.unary_unary(
        "/detlogp.v1.LogProbService/ComputeLogProbs",
        request_serializer=identity,
        response_deserializer=identity,
    )
    stream = channel.stream_stream(
        "/detlogp.v1.LogProbService/StreamLogProbs",
        request_serializer=identity,
        response_deserializer=identity,
    )
    return unary, stream


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """One server process. `args` are extra flags; with metrics=True,
    --metrics_port=0 is passed when the binary has that flag (metrics() then
    reads its Prometheus endpoint)."""

    def __init__(self, binary, args=(), *, metrics=False, start_timeout=60.0, workdir=None):
        self.binary = pathlib.Path(binary)
        if not self.binary.exists():
            raise FileNotFoundError(
                f"{self.binary} is missing: run `bazel build //server:detlogp_server`"
            )
        self.args = list(args)
        self.start_timeout = start_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="detlogp-server-", dir=workdir)
        self.port_file = pathlib.Path(self._tmp.name) / "port"
        self.log_path = pathlib.Path(self._tmp.name) / "server.log"
        self.metrics_port = None
        self.want_metrics = metrics and "metrics_port" in server_flags(str(self.binary))
        self.process = None
        self.port = None
        self.returncode = None

    # ------------------------------------------------------------ lifecycle
    def start(self, port=0):
        """Starts the server (port 0: a free one) and waits until it serves."""
        self.port_file.unlink(missing_ok=True)
        cmd = [
            str(self.binary),
            f"--port={port}",
            f"--port_file={self.port_file}",
            "--host=127.0.0.1",
            *self.args,
        ]
        if self.want_metrics:
            cmd.append("--metrics_port=0")  # its port: the port file's 2nd line
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.returncode = None
        end = time.monotonic() + self.start_timeout
        while not self.port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}:\n" + self.log()[-3000:]
                )
            if time.monotonic() > end:
                self.kill()
                raise TimeoutError("server did not start:\n" + self.log()[-3000:])
            time.sleep(0.02)
        try:
            lines = self.port_file.read_text().split()
            self.port = int(lines[0])
            if self.want_metrics and len(lines) > 1 and int(lines[1]) > 0:
                self.metrics_port = int(lines[1])
        except (ValueError, IndexError):
            self.kill()  # never leave a server behind
            raise
        return self

    @property
    def target(self):
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self):
        return self.process.pid

    def running(self):
        return self.process is not None and self.process.poll() is None

    def terminate(self, timeout=60.0):
        """SIGTERM, then waits for exit; returns the exit code."""
        if self.running():
            self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self):
        """SIGKILL (no drain); returns the exit code (-9)."""
        if self.running():
            self.process.kill()
        return self.wait(30.0)

    def wait(self, timeout):
        if self.process is None:
            return None
        try:
            self.returncode = self.process.wait(timeout)
        finally:
            self._log.close()
        return self.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if self.running():
            self.terminate(timeout=30.0) if exc[0] is None else self.kill()
        self._tmp.cleanup()

    # ------------------------------------------------------------ observing
    def log(self):
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def rss_kib(self):
        """Resident set size of the server process, KiB."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def cpu_seconds(self):
        """User + system CPU seconds the server process has used so far."""
        with open(f"/proc/{self.pid}/stat") as f:
            line = f.read()
        # The fields after the command name, which may hold spaces: utime and
        # stime are fields 14 and 15 of the whole line.
        after_name = line[line.rindex(")") + 2 :].split()
        return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")

    def stop_counts(self):
        """The shutdown log line's counters, or None if it was not written."""
        match = _STOPPED.search(self.log())
        if not match:
            return None
        keys = ("batches", "computed", "expired", "cancelled", "rejected")
        return dict(zip(keys, map(int, match.groups())))

    def metrics(self):
        """Prometheus samples {name{labels}: value} from --metrics_port, or
        None without a metrics endpoint."""
        if not self.metrics_port:
            return None
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    samples[name] = float(value)
                except ValueError:
                    pass
        return samples


class TestModel:
    """A small lm_head written to `folder`/lm_head.safetensors: bf16 weight
    [padded_vocab, hidden] ~ N(0, scale^2), fp32 bias, real vocabulary
    `vocab` (rows beyond it are padding the server must ignore)."""

    __test__ = False  # not a pytest class

    def __init__(
        self, folder, *, hidden=64, vocab=1000, padded_vocab=1024, seed=7, scale=0.5, with_bias=True
    ):
        import numpy as np

        from detlogp import safetensors_io, tensors

        rng = np.random.default_rng(seed)
        self.hidden = hidden
        self.vocab = vocab
        self.padded_vocab = padded_vocab
        weight = (rng.standard_normal((padded_vocab, hidden)) * scale).astype(np.float32)
        self.weight_bits = tensors.float32_to_bf16_bits(weight)
        self.bias = (
            (rng.standard_normal(padded_vocab) * 0.5).astype(np.float32) if with_bias else None
        )
        named = {"lm_head.weight": self.weight_bits}
        if with_bias:
            named["lm_head.bias"] = self.bias
        self.path = pathlib.Path(folder) / f"lm_head_{seed}.safetensors"
        safetensors_io.write(self.path, named)
        self.flags = [
            f"--weights={self.path}",
            "--lm_head_tensor=lm_head.weight",
            f"--vocab_size={vocab}",
        ]
        if with_bias:
            self.flags.append("--bias_tensor=lm_head.bias")

    def reference(self, hidden, targets, temperature=1.0):
        """float64 (logprobs, lse) for these rows."""
        from detlogp import reference

        return reference.logprobs(
            hidden, targets, self.weight_bits, self.bias, temperature, self.vocab
        )

    def reference_entropy_top_k(self, hidden, k, temperature=1.0):
        """float64 (entropy, top_ids [N, k], top_logprobs [N, k])."""
        from detlogp import reference

        return reference.entropy_top_k(
            hidden, self.weight_bits, self.bias, temperature, self.vocab, k
        )

    def random_rows(self, n, seed):
        """n float32 rows and n valid targets, deterministic in `seed`."""
        import numpy as np

        rng = np.random.default_rng(seed)
        return (
            rng.standard_normal((n, self.hidden)).astype(np.float32),
            rng.integers(0, self.vocab, size=n),
        )


def seeded_rows(seed, rows, hidden, vocab):
    """`rows` float32 rows ~N(0, 1) and valid targets, the same for a seed in
    any process."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((rows, hidden)).astype(np.float32),
        rng.integers(0, vocab, size=rows),
    )


def rollout_worker(target, seed, rows, hidden, vocab, rounds, start, answers):
    """One rollout worker of a burst (run in a process of its own): `rounds`
    calls of seeded_rows(seed * 100 + round), each once `start` is set; puts
    (seed, round, logprobs bytes or None, error text or None) on
    `answers`."""
    import detlogp

    with detlogp.Client(target, timeout=600) as client:
        for round_index in range(rounds):
            hidden_rows, targets = seeded_rows(seed * 100 + round_index, rows, hidden, vocab)
            start.wait()
            try:
                result = client.logprobs(hidden_rows, targets)
            except detlogp.DetlogpError as error:
                answers.put((seed, round_index, None, f"{type(error).__name__}: {error}"))
                continue
            answers.put((seed, round_index, result.logprobs.tobytes(), None))
