"""Fixtures: a real detlogp_server on a loopback port serving a small lm_head
that the tests wrote themselves (so a float64 numpy reference can check it).

Nothing is built: bazel-bin/server/detlogp_server must exist
(`bazel build //server:detlogp_server`), or $DETLOGP_SERVER must name it.
"""

import pathlib

import detlogp
import pytest
from detlogp.testing import LocalServer, TestModel, server_binary_for_tests

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
MAX_REQUEST_ROWS = 64


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def max_request_rows():
    """--max_request_rows of the `server` fixture."""
    return MAX_REQUEST_ROWS


@pytest.fixture(scope="session")
def server_binary():
    return server_binary_for_tests(REPO_ROOT)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    return TestModel(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def server(server_binary, model):
    with LocalServer(
        server_binary, model.flags + [f"--max_request_rows={MAX_REQUEST_ROWS}", "--cpu_threads=1"]
    ) as srv:
        yield srv


@pytest.fixture
def client(server):
    with detlogp.Client(server.target, timeout=20.0) as c:
        yield c
