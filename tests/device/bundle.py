"""The bundle that tools/device/bundle.sh builds, as the device suites see it.

    bin/        the server, the CLI, the serving benchmarks, the GPU gtests
    lib/        the ops libraries, the C++ client's library, liblogp_bench.so
    runfiles/   where the server-process gtests find the binaries
    python/     client/python
    scripts/    tools/device/*.py, the examples and load generator
    tests/      these suites
    gpu_tests.txt, memcheck.json, COMMIT

The suites run from the bundle's own tests/device (tools/device/run_suite.sh)
or from the tree with DETLOGP_BUNDLE naming an unpacked bundle.
"""

import dataclasses
import json
import os
import pathlib

HERE = pathlib.Path(__file__).resolve().parent


def find_bundle():
    """$DETLOGP_BUNDLE, else the bundle these suites were copied into, else
    .device/bundle in the tree; None when none holds a server binary."""
    candidates = []
    if os.environ.get("DETLOGP_BUNDLE"):
        candidates.append(pathlib.Path(os.environ["DETLOGP_BUNDLE"]))
    candidates.append(HERE.parents[1])  # <bundle>/tests/device
    candidates.append(HERE.parents[1] / ".device" / "bundle")  # <tree>/tests/device
    for root in candidates:
        if (root / "bin" / "detlogp_server").exists():
            return Bundle(root.resolve())
    return None


@dataclasses.dataclass(frozen=True)
class Bundle:
    root: pathlib.Path

    def bin(self, name):
        return self.root / "bin" / name

    def lib(self, name):
        return self.root / "lib" / name

    def script(self, name):
        return self.root / "scripts" / name

    @property
    def server(self):
        return self.bin("detlogp_server")

    @property
    def cli(self):
        return self.bin("detlogp_cli")

    @property
    def runfiles(self):
        return self.root / "runfiles"

    def gpu_tests(self):
        """The gtest binaries tagged "gpu" (gpu_tests.txt, one a line)."""
        text = (self.root / "gpu_tests.txt").read_text()
        return [line.strip() for line in text.splitlines() if line.strip()]

    def memcheck_filters(self):
        """{gtest binary: --gtest_filter} of the memcheck targets
        (tests/cuda/memcheck.bzl, written by bundle.sh as memcheck.json)."""
        return json.loads((self.root / "memcheck.json").read_text())

    def environment(self):
        """What the bundle's programs and Python package need: its libraries
        on the loader's path, the package and the libraries detlogp loads."""
        env = {
            "LD_LIBRARY_PATH": os.pathsep.join(
                p for p in (str(self.root / "lib"), os.environ.get("LD_LIBRARY_PATH")) if p
            ),
            "DETLOGP_OPS_LIBRARY": str(self.lib("libdetlogp_ops.so")),
            "DETLOGP_OPS_CUDA_LIBRARY": str(self.lib("libdetlogp_ops_cuda.so")),
            "DETLOGP_CLIENT_LIBRARY": str(self.lib("libdetlogp_client.so")),
            "DETLOGP_SERVER": str(self.server),
            "DETLOGP_BUNDLE": str(self.root),
            "PYTHONUNBUFFERED": "1",
        }
        python = str(self.root / "python" / "client")
        path = os.environ.get("PYTHONPATH", "")
        if python not in path.split(os.pathsep):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (path, python) if p)
        return env
