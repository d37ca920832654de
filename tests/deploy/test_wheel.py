"""The self-contained wheel (tools/build_wheel.sh): installed into a clean
venv, its C++ engine loads gRPC, protobuf and Abseil from the libraries
vendored in the wheel, and a large call goes through that engine with the
bits grpcio gets.

$DETLOGP_WHEEL names a wheel built already; otherwise the test builds one
(a few minutes on a 2-core host)."""

import os
import pathlib
import subprocess
import sys
import venv

import pytest
from detlogp.testing import LocalServer, TestModel, server_binary_for_tests

REPO = pathlib.Path(__file__).resolve().parents[2]

CALL = r"""
import json, sys
import numpy as np
import detlogp
from detlogp import engine

target, hidden_size, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(5)
n = (8 << 20) // (hidden_size * 2) + 13  # past the size the engine takes
hidden = rng.standard_normal((n, hidden_size)).astype(np.float32)
targets = rng.integers(0, vocab, size=n)
answers = {}
for mode in ("on", "off"):
    options = detlogp.TransferOptions(native_transport=mode)
    with detlogp.Client(
        target, timeout=120, transfer_options=options, shared_memory="off"
    ) as client:
        answers[mode] = client.logprobs(hidden, targets)
maps = open("/proc/self/maps").read()
loaded = sorted({line.split()[-1] for line in maps.splitlines() if "libgrpc++" in line})
print(json.dumps({
    "engine": answers["on"].engine,
    "python_engine": answers["off"].engine,
    "same_bits": answers["on"].logprobs.tobytes() == answers["off"].logprobs.tobytes(),
    "library": str(engine.find_library()),
    "grpc_loaded_from": loaded,
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    given = os.environ.get("DETLOGP_WHEEL")
    if given:
        return pathlib.Path(given)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [str(REPO / "tools" / "build_wheel.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return pathlib.Path(built.stdout.strip().splitlines()[-1])


def test_the_wheel_brings_its_engine_and_the_libraries_it_loads(wheel, tmp_path):
    assert "manylinux" in wheel.name, wheel.name
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # Outside the repository, with nothing pointing at the package or a
    # library there (pip too would take a detlogp on PYTHONPATH as installed).
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETLOGP_")}
    env.pop("PYTHONPATH", None)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)], check=True, env=env, cwd=tmp_path
    )
    model = TestModel(tmp_path, hidden=128, vocab=256, padded_vocab=256, seed=21)
    binary = server_binary_for_tests(REPO)
    with LocalServer(binary, ["--device=cpu", *model.flags]) as server:
        ran = subprocess.run(
            [str(python), "-c", CALL, server.target, str(model.hidden), str(model.vocab)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=600,
        )
    assert ran.returncode == 0, ran.stderr[-4000:]
    import json

    said = json.loads(ran.stdout.strip().splitlines()[-1])
    print(said)
    assert said["engine"] == "native"
    assert said["python_engine"] == "python"
    assert said["same_bits"]
    site = str(env_dir)
    assert said["library"].startswith(site), said["library"]
    assert said["grpc_loaded_from"], said
    assert all(path.startswith(site) for path in said["grpc_loaded_from"]), said


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
