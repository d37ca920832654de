"""The GPU-host suites: one pytest marker per suite, run from the bundle
that tools/device/bundle.sh builds (tools/device/run_suite.sh SUITE runs
`pytest -m SUITE` there). Without an NVIDIA GPU or a bundle every case is
skipped with the reason; CI (no GPU) does not collect this folder.

Logs, JSON reports and benchmark figures go to --device_out (default $OUT,
else /tmp/detlogp-device), one folder a suite.
"""

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bundle import find_bundle  # noqa: E402
from gpu import gpus  # noqa: E402

SUITES = {
    "tests": "every GPU gtest binary (tests tagged gpu)",
    "kernels": "the Hopper linear-logp kernel: its gtests, memcheck, benchmarks",
    "portable": "the portable mma.sync kernel: memcheck, gtests, served over gRPC",
    "serve": "the server on cuda:0: bits over gRPC, throughput, latency, projection",
    "live_weights": "versions swapped under load, --model_root persistence and restart",
    "projection": "the projection's GPU gtests and kernels against PyTorch",
    "projection_stream": "one H3 video streamed from cuda:0 at each rows_per_chunk",
    "twin": "detlogp.torch on CUDA: its pytest cases, twin_check.py, the GRPO example",
    "rollout": "the client's GPU pytest cases and one rollout worker's large batch",
    "fleet_burst": "many rollout workers' large CUDA batches at once against one server",
    "fanout": "one push to 8 servers on cuda:0 down a chain, against one server alone",
    "backward": "the fused backward: gtests, then beside PyTorch eager and Liger",
    "soak": "cancellation storms against a GPU server: the server's memory stays flat",
}


def pytest_addoption(parser):
    parser.addoption(
        "--device_out",
        default=os.environ.get("OUT") or "/tmp/detlogp-device",
        help="where the suites write logs, JSON reports and figures",
    )


def pytest_configure(config):
    for marker, what in SUITES.items():
        config.addinivalue_line("markers", f"{marker}: {what}")


def pytest_collection_modifyitems(config, items):
    if not gpus():
        reason = "no NVIDIA GPU on this host (nvidia-smi is missing or lists none)"
    elif find_bundle() is None:
        reason = "no bundle: run tools/device/bundle.sh and set DETLOGP_BUNDLE"
    else:
        return
    here = pathlib.Path(__file__).resolve().parent
    for item in items:
        if here in pathlib.Path(item.path).resolve().parents:  # this folder's only
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def bundle():
    found = find_bundle()
    os.environ.update(found.environment())
    return found


@pytest.fixture(scope="session")
def gpu():
    """GPU 0, as nvidia-smi reads it."""
    return gpus()[0]


@pytest.fixture(scope="module")
def out(request):
    """This suite's folder for logs and reports: <device_out>/<suite>."""
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    folder = pathlib.Path(request.config.getoption("--device_out")) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def serving(bundle, out):
    """serving(name, *flags): a LocalServer of the bundle's server, its log
    kept as out/server_NAME.log."""
    from detlogp.testing import LocalServer

    @contextlib.contextmanager
    def start(name, *flags):
        server = LocalServer(bundle.server, list(flags), metrics=True, start_timeout=180.0)
        with server:
            try:
                yield server
            finally:
                shutil.copyfile(server.log_path, out / f"server_{name}.log")

    return start


@pytest.fixture(scope="module")
def run(out):
    """run(name, argv, timeout_s, json_path=None): argv's output in
    out/NAME.log; fails on a non-zero exit (with the log's tail), returns
    the JSON file's content (or, with json_path="stdout", the last line of
    stdout that is a JSON object)."""

    def call(name, argv, timeout_s, json_path=None, env=None):
        log = out / f"{name}.log"
        try:
            done = subprocess.run(
                [str(a) for a in argv],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, **(env or {})},
            )
        except subprocess.TimeoutExpired as timeout:
            log.write_text(f"{timeout.stdout or ''}\n{timeout.stderr or ''}")
            raise AssertionError(f"{name}: timed out after {timeout_s} s (log {log})") from None
        log.write_text(done.stdout + ("\n--- stderr\n" + done.stderr if done.stderr else ""))
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        assert done.returncode == 0, f"{name}: exit code {done.returncode} (log {log}):\n{tail}"
        if json_path is None:
            return None
        if json_path == "stdout":
            for line in reversed(done.stdout.splitlines()):
                if line.startswith("{"):
                    return json.loads(line)
            raise AssertionError(f"{name}: no JSON line in its output (log {log})")
        return json.loads(pathlib.Path(json_path).read_text())

    return call


@pytest.fixture(scope="module")
def figures(out):
    """figures[key] = value: the suite's measured figures, written to
    out/figures.json when the module ends (what docs/performance.md cites)."""
    found = {}
    yield found
    (out / "figures.json").write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
