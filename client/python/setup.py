"""Build hook: the trainer-side ops libraries inside the package.

`pip install ./client/python` compiles the CPU ops library libdetlogp_ops.so
(kernels/capi/detlogp_ops.h over the CPU kernels) with the system C++
compiler and ships it in detlogp/_lib/, where detlogp.ops finds it: the ops
work wherever the package is installed, with the CPU server's bits. The
compiler flags are the Bazel build's (.bazelrc and the kernels' BUILD
copts): a fixed ISA (x86-64-v3) and no FMA contraction, so the library's bits
are the Bazel-built library's (client/python/tests/test_ops.py compares the
installed library with a running server).

DETLOGP_BUILD_OPS chooses what is built:

    unset, "cpu"  libdetlogp_ops.so (the default)
    "1", "cuda"   libdetlogp_ops.so, and libdetlogp_ops_cuda.so through the
                  project's Bazel build when nvcc is installed
                  (/usr/local/cuda/bin/nvcc; needs the repository around this
                  folder)
    "0"           nothing: the pure-Python client (detlogp.ops then looks
                  for $DETLOGP_OPS_LIBRARY or bazel-bin/)

The CPU build needs a C++17 compiler ($CXX, default g++) and the headers and
libraries of Abseil and OpenSSL's libcrypto (Debian: libabsl-dev,
libssl-dev). Its sources are the repository's kernels/, kernels/capi/ and
digests/: found around this folder (pip builds a local folder in place), or
in ops_src/ of an sdist (put there when the sdist is made). Everything else
is in pyproject.toml.
"""

import concurrent.futures
import os
import pathlib
import shlex
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
SDIST_SOURCES = "ops_src"  # the kernels' sources inside an sdist

# The CPU library's translation units and the copts their Bazel targets add
# (kernels/BUILD: linear_logp_cpu and projection build with -O3).
CPU_SOURCES = {
    "kernels/capi/detlogp_ops.cc": [],
    "kernels/capi/capi_util.cc": [],
    "kernels/linear_logp_cpu.cc": ["-O3"],
    "kernels/projection.cc": ["-O3"],
    "kernels/projection_grad.cc": ["-O3"],
    "kernels/parallel_for.cc": [],
    "kernels/thread_pool.cc": [],
    "digests/determinism_key.cc": [],
    "digests/lm_head_digest.cc": [],
    "digests/sha256.cc": [],
}
# Headers live beside the sources: every .h of these folders.
HEADER_DIRS = ["kernels", "kernels/capi", "digests"]
# .bazelrc's flags that decide the bits, then the shared-library ones.
CPU_FLAGS = [
    "-std=c++17",
    "-O2",
    "-march=x86-64-v3",
    "-ffp-contract=off",
    "-fPIC",
    "-fno-omit-frame-pointer",
    "-Wall",
]
# third_party/BUILD's Abseil, without the flags libraries (no main here).
CPU_LIBS = [
    "-lcrypto",
    "-labsl_statusor",
    "-labsl_status",
    "-labsl_str_format_internal",
    "-labsl_synchronization",
    "-labsl_time",
    "-labsl_time_zone",
    "-labsl_hash",
    "-labsl_raw_hash_set",
    "-labsl_strings",
    "-labsl_strings_internal",
    "-labsl_throw_delegate",
    "-labsl_int128",
    "-labsl_base",
    "-labsl_raw_logging_internal",
    "-labsl_log_severity",
    "-labsl_spinlock_wait",
    "-lpthread",
]
CPU_LIBRARY = "libdetlogp_ops.so"
CUDA_LIBRARY = "libdetlogp_ops_cuda.so"


def _mode():
    mode = os.environ.get("DETLOGP_BUILD_OPS", "").strip().lower()
    if mode in ("", "cpu"):
        return "cpu"
    if mode in ("0", "no", "false", "none"):
        return "none"
    if mode in ("1", "yes", "true", "cuda"):
        return "cuda"
    raise RuntimeError(f"DETLOGP_BUILD_OPS={mode!r}: expected unset, cpu, 1 (cuda) or 0")


def _source_root():
    """The folder holding kernels/ and digests/: an sdist's ops_src, else the
    repository around this folder."""
    for root in (HERE / SDIST_SOURCES, REPO):
        if all((root / source).is_file() for source in CPU_SOURCES):
            return root
    raise RuntimeError(
        "detlogp: the CPU ops library's sources (kernels/, digests/) are neither in "
        f"{HERE / SDIST_SOURCES} nor in {REPO}: install from a detlogp checkout "
        "(pip install ./client/python) or from its sdist, or set DETLOGP_BUILD_OPS=0 "
        "for the client without the ops"
    )


def _run(command, what):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"detlogp: {what} failed (exit {result.returncode}); the CPU ops library "
            "needs a C++17 compiler ($CXX, default g++) and Abseil and OpenSSL "
            "(Debian: libabsl-dev libssl-dev), or DETLOGP_BUILD_OPS=0 for the client "
            f"without the ops.\n$ {shlex.join(command)}\n{result.stdout}{result.stderr}"
        )


def build_cpu_library(output, temp_dir):
    """Compiles and links libdetlogp_ops.so at `output` (objects in temp_dir)."""
    root = _source_root()
    compiler = os.environ.get("CXX", "g++")
    temp_dir = pathlib.Path(temp_dir)
    temp_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for source, copts in CPU_SOURCES.items():
        obj = temp_dir / (source.replace("/", "_") + ".o")
        command = [compiler, *CPU_FLAGS, *copts, "-iquote", str(root)]
        jobs.append(([*command, "-c", str(root / source), "-o", str(obj)], obj, source))
    print(f"detlogp: compiling {CPU_LIBRARY} ({len(jobs)} files, {compiler})")
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for future in [pool.submit(_run, cmd, f"compiling {src}") for cmd, _, src in jobs]:
            future.result()
    output = pathlib.Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    link = [compiler, "-shared", "-o", str(output), *(str(obj) for _, obj, _ in jobs)]
    _run([*link, "-Wl,--no-undefined", "-Wl,-z,relro,-z,now", *CPU_LIBS], "linking")
    os.chmod(output, 0o755)


def build_cuda_library(output):
    """libdetlogp_ops_cuda.so through the repository's Bazel build."""
    if not (REPO / "WORKSPACE").exists():
        raise RuntimeError(
            f"DETLOGP_BUILD_OPS=1: {REPO} is not the detlogp repository; the CUDA "
            "library builds with Bazel from a checkout (pip install ./client/python)"
        )
    target = f"//kernels/capi:{CUDA_LIBRARY}"
    subprocess.run(["bazel", "build", target], cwd=REPO, check=True)
    shutil.copyfile(REPO / "bazel-bin" / "kernels" / "capi" / CUDA_LIBRARY, output)
    os.chmod(output, 0o755)


class BuildPyWithOps(build_py):
    def run(self):
        super().run()
        mode = _mode()
        if mode == "none":
            return
        lib_dir = pathlib.Path(self.build_lib) / "detlogp" / "_lib"
        temp = pathlib.Path(self.get_finalized_command("build").build_temp) / "detlogp_ops"
        build_cpu_library(lib_dir / CPU_LIBRARY, temp)
        if mode == "cuda":
            if os.path.exists("/usr/local/cuda/bin/nvcc"):
                build_cuda_library(lib_dir / CUDA_LIBRARY)
            else:
                print("detlogp: no /usr/local/cuda/bin/nvcc: building the CPU ops only")


class SdistWithSources(sdist):
    """Puts the CPU library's sources in the sdist (ops_src/), so that a
    wheel builds from the sdist alone."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = _source_root()
        target = pathlib.Path(base_dir) / SDIST_SOURCES
        names = set(CPU_SOURCES)
        for folder in HEADER_DIRS:
            names.update(str(p.relative_to(root)) for p in (root / folder).glob("*.h"))
        for name in sorted(names):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, target / name)


class BinaryDistribution(Distribution):
    """The wheel holds a compiled library: tag it for this platform."""

    def has_ext_modules(self):
        return _mode() != "none"


setup(
    cmdclass={"build_py": BuildPyWithOps, "sdist": SdistWithSources},
    distclass=BinaryDistribution,
)
