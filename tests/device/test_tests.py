"""tests: every GPU gtest binary of the bundle (the tests tagged "gpu";
DETLOGP_GPU_TESTS="a b" runs those alone). None may fail or run no case;
none may skip one on a Hopper GPU. Elsewhere the Hopper cases skip
themselves, and the skips are allowed."""

import os

import pytest
from bundle import find_bundle
from gtest import assert_gtest_passed, run_gtest

pytestmark = pytest.mark.tests

TIMEOUT_S = float(os.environ.get("DETLOGP_GTEST_TIMEOUT_S", "600"))


def gpu_tests():
    if os.environ.get("DETLOGP_GPU_TESTS"):
        return os.environ["DETLOGP_GPU_TESTS"].split()
    found = find_bundle()
    return found.gpu_tests() if found else []


@pytest.mark.parametrize("name", gpu_tests())
def test_gpu_gtest(bundle, gpu, out, name):
    result = run_gtest(bundle, name, out, timeout_s=TIMEOUT_S)
    print(result.summary())
    assert_gtest_passed(result, skips_allowed=not gpu.is_hopper)
