"""Fixtures for the reliability suite: the real server binary (nothing is
built here), a small lm_head the tests wrote, and a report helper.

Every test prints what it tried and what held; run with -s (or read the
captured output of a failure) to see the counts. Durations are bounded and
can be shortened for a quick local run with DETLOGP_SOAK_S=10.
"""

import os
import pathlib

import pytest
from detlogp.testing import TestModel, server_binary_for_tests

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def server_binary():
    return server_binary_for_tests(REPO_ROOT)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    """H=64, V=1000 (padded 1024): cheap rows keep the 2-core box sane."""
    return TestModel(tmp_path_factory.mktemp("reliability-model"), seed=3)


@pytest.fixture(scope="session")
def soak_seconds():
    return float(os.environ.get("DETLOGP_SOAK_S", "60"))


@pytest.fixture
def report(request):
    """report(line): prints `[test] line` so the counts show in the log."""
    name = request.node.name

    def say(line):
        print(f"[{name}] {line}", flush=True)

    return say
