"""Build hook for the optional trainer-side ops libraries.

`pip install ./client/python` installs the pure-Python package (no build).
With DETLOGP_BUILD_OPS set, the install first builds the ops libraries with
the project's own Bazel build (from the repository around this folder) and
ships them inside the package (detlogp/_lib/), where detlogp.ops finds them:

    DETLOGP_BUILD_OPS=1    libdetlogp_ops.so, and libdetlogp_ops_cuda.so
                           when nvcc is installed (/usr/local/cuda/bin/nvcc)
    DETLOGP_BUILD_OPS=cpu  libdetlogp_ops.so only

The libraries link the system's Abseil and the CUDA runtime of the build
machine: install where you build (or put those on the loader's path).
Everything else is in pyproject.toml.
"""

import os
import pathlib
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent


class BuildPyWithOps(build_py):
    def run(self):
        super().run()
        mode = os.environ.get("DETLOGP_BUILD_OPS", "").strip().lower()
        if mode in ("", "0", "no", "false"):
            return
        targets = ["//kernels/capi:libdetlogp_ops.so"]
        cuda = mode != "cpu" and os.path.exists("/usr/local/cuda/bin/nvcc")
        if mode != "cpu" and not cuda:
            print("detlogp: no /usr/local/cuda/bin/nvcc: building the CPU ops only")
        if cuda:
            targets.append("//kernels/capi:libdetlogp_ops_cuda.so")
        if not (REPO / "WORKSPACE").exists():
            raise RuntimeError(
                f"DETLOGP_BUILD_OPS: {REPO} is not the detlogp repository "
                "(install from a checkout: pip install ./client/python)"
            )
        config = [] if cuda else ["--config=nocuda"]
        subprocess.run(["bazel", "build", *config, *targets], cwd=REPO, check=True)
        lib_dir = pathlib.Path(self.build_lib) / "detlogp" / "_lib"
        lib_dir.mkdir(parents=True, exist_ok=True)
        for target in targets:
            name = target.split(":")[1]
            shutil.copyfile(REPO / "bazel-bin" / "kernels" / "capi" / name, lib_dir / name)
            os.chmod(lib_dir / name, 0o755)


setup(cmdclass={"build_py": BuildPyWithOps})
