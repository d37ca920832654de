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
in ops_src/ of an sdist (put there when the sdist is made).

The C++ client's library libdetlogp_client.so (client/capi/detlogp_client.h,
the engine detlogp.engine hands every call larger than one request to) is
built beside it from client/
and proto/ when gRPC's C++ build tools are there: protoc, grpc_cpp_plugin
and pkg-config's grpc++, protobuf and spdlog (Debian: protobuf-compiler-grpc,
libgrpc++-dev, libprotobuf-dev, libspdlog-dev, pkg-config). DETLOGP_BUILD_CLIENT chooses:

    unset, "auto" built when those are found, else skipped, saying why
                  (calls larger than one request then raise EngineRequired)
    "1"           built, or the install fails saying what is missing
    "0"           not built

Everything else is in pyproject.toml.
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

# The C++ client's library: its translation units (client/BUILD's
# logp_client and what it depends on, client/capi's C ABI) and the API they
# are generated from.
CLIENT_SOURCES = {
    "client/capi/detlogp_client.cc": [],
    "client/logp_client.cc": [],
    "client/logp_client_regions.cc": [],
    "client/request_rows.cc": [],
    "client/project_streams.cc": [],
    "client/project_chunk.cc": [],
    "client/system_shared_memory.cc": [],
    "client/cuda_runtime_loader.cc": [],
    "client/call_engine.cc": [],
    "client/score_result.cc": [],
    "client/request_bytes.cc": [],
    "client/region_api.cc": [],
    "client/task_pool.cc": [],
    "client/grpc_lifetime.cc": [],
    "client/target_resolver.cc": [],
    "proto/status_details.cc": [],
}
CLIENT_PROTOS = [
    "proto/detlogp/v1/detlogp.proto",
    "proto/google/rpc/status.proto",
    "proto/google/rpc/error_details.proto",
]
CLIENT_HEADER_DIRS = ["client", "client/capi", "proto"]
CLIENT_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-Wall"]
CLIENT_PKG_CONFIG = ["grpc++", "protobuf", "spdlog"]
CLIENT_LIBRARY = "libdetlogp_client.so"


def _mode():
    mode = os.environ.get("DETLOGP_BUILD_OPS", "").strip().lower()
    if mode in ("", "cpu"):
        return "cpu"
    if mode in ("0", "no", "false", "none"):
        return "none"
    if mode in ("1", "yes", "true", "cuda"):
        return "cuda"
    raise RuntimeError(f"DETLOGP_BUILD_OPS={mode!r}: expected unset, cpu, 1 (cuda) or 0")


def _client_mode():
    mode = os.environ.get("DETLOGP_BUILD_CLIENT", "").strip().lower()
    if mode in ("", "auto"):
        return "auto"
    if mode in ("0", "no", "false", "none"):
        return "none"
    if mode in ("1", "yes", "true"):
        return "required"
    raise RuntimeError(f"DETLOGP_BUILD_CLIENT={mode!r}: expected unset, auto, 1 or 0")


def _source_root(sources=CPU_SOURCES, required=True):
    """The folder holding `sources`: an sdist's ops_src, else the repository
    around this folder (None when neither and not `required`)."""
    for root in (HERE / SDIST_SOURCES, REPO):
        if all((root / source).is_file() for source in sources):
            return root
    if not required:
        return None
    raise RuntimeError(
        "detlogp: the CPU ops library's sources (kernels/, digests/) are neither in "
        f"{HERE / SDIST_SOURCES} nor in {REPO}: install from a detlogp checkout "
        "(pip install ./client/python) or from its sdist, or set DETLOGP_BUILD_OPS=0 "
        "for the client without the ops"
    )


OPS_NEEDS = (
    "the CPU ops library needs a C++17 compiler ($CXX, default g++) and Abseil and "
    "OpenSSL (Debian: libabsl-dev libssl-dev), or DETLOGP_BUILD_OPS=0 for the client "
    "without the ops"
)
CLIENT_NEEDS = (
    f"{CLIENT_LIBRARY} needs a C++17 compiler, gRPC's C++ build and spdlog (Debian: "
    "protobuf-compiler-grpc libgrpc++-dev libprotobuf-dev libspdlog-dev pkg-config), or "
    "DETLOGP_BUILD_CLIENT=0 for the client without it"
)


def _run(command, what, needs=OPS_NEEDS):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"detlogp: {what} failed (exit {result.returncode}); {needs}."
            f"\n$ {shlex.join(command)}\n{result.stdout}{result.stderr}"
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
    _compile_all(jobs, OPS_NEEDS)
    output = pathlib.Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    link = [compiler, "-shared", "-o", str(output), *(str(obj) for _, obj, _ in jobs)]
    _run([*link, "-Wl,--no-undefined", "-Wl,-z,relro,-z,now", *CPU_LIBS], "linking")
    os.chmod(output, 0o755)


def _compile_all(jobs, needs):
    """Runs the (command, object, source) compile jobs side by side."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = [pool.submit(_run, cmd, f"compiling {src}", needs) for cmd, _, src in jobs]
        for future in futures:
            future.result()


def client_build_missing():
    """Why libdetlogp_client.so cannot be built here, or None."""
    for tool in ("protoc", "grpc_cpp_plugin", "pkg-config"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    probe = subprocess.run(
        ["pkg-config", "--exists", *CLIENT_PKG_CONFIG], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"pkg-config finds no {' and '.join(CLIENT_PKG_CONFIG)}"
    if _source_root([*CLIENT_SOURCES, *CLIENT_PROTOS], required=False) is None:
        return "the client's sources (client/, proto/) are not around this folder"
    return None


def build_client_library(output, temp_dir):
    """Generates the API's C++ and compiles and links libdetlogp_client.so at
    `output` (generated files and objects in temp_dir)."""
    root = _source_root([*CLIENT_SOURCES, *CLIENT_PROTOS])
    compiler = os.environ.get("CXX", "g++")
    temp_dir = pathlib.Path(temp_dir)
    generated = temp_dir / "generated"
    generated.mkdir(parents=True, exist_ok=True)
    proto_root = root / "proto"
    _run(
        [
            "protoc",
            f"-I{proto_root}",
            f"--cpp_out={generated}",
            f"--grpc_out={generated}",
            f"--plugin=protoc-gen-grpc={shutil.which('grpc_cpp_plugin')}",
            *(str(root / proto) for proto in CLIENT_PROTOS),
        ],
        "generating the API's C++",
        CLIENT_NEEDS,
    )
    sources = {str(root / s): s for s in CLIENT_SOURCES}
    for proto in CLIENT_PROTOS:
        api = pathlib.Path(proto).relative_to("proto").with_suffix("")
        for suffix in (".pb.cc", ".grpc.pb.cc"):
            path = generated / f"{api}{suffix}"
            sources[str(path)] = str(path.relative_to(generated))
    pkg = subprocess.run(
        ["pkg-config", "--cflags", "--libs", *CLIENT_PKG_CONFIG],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    cflags = [f for f in pkg if not f.startswith(("-l", "-L", "-Wl"))]
    libs = [f for f in pkg if f not in cflags]
    jobs = []
    for path, name in sources.items():
        obj = temp_dir / (name.replace("/", "_") + ".o")
        command = [compiler, *CLIENT_FLAGS, *cflags, "-iquote", str(root), "-I", str(generated)]
        jobs.append(([*command, "-c", path, "-o", str(obj)], obj, name))
    print(f"detlogp: compiling {CLIENT_LIBRARY} ({len(jobs)} files, {compiler})")
    _compile_all(jobs, CLIENT_NEEDS)
    output = pathlib.Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    link = [compiler, "-shared", "-o", str(output), *(str(obj) for _, obj, _ in jobs)]
    _run(
        [*link, "-Wl,--no-undefined", "-Wl,-z,relro,-z,now", *libs, "-ldl", "-lrt"],
        "linking",
        CLIENT_NEEDS,
    )
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
        lib_dir = pathlib.Path(self.build_lib) / "detlogp" / "_lib"
        build_temp = pathlib.Path(self.get_finalized_command("build").build_temp)
        client = _client_mode()
        if client != "none":
            missing = client_build_missing()
            if missing is None:
                build_client_library(lib_dir / CLIENT_LIBRARY, build_temp / "detlogp_client")
            elif client == "required":
                raise RuntimeError(f"DETLOGP_BUILD_CLIENT=1: {CLIENT_LIBRARY}: {missing}")
            else:
                print(
                    f"detlogp: not building {CLIENT_LIBRARY} ({missing}); calls larger "
                    "than one request will need it"
                )
        mode = _mode()
        if mode == "none":
            return
        build_cpu_library(lib_dir / CPU_LIBRARY, build_temp / "detlogp_ops")
        if mode == "cuda":
            if os.path.exists("/usr/local/cuda/bin/nvcc"):
                build_cuda_library(lib_dir / CUDA_LIBRARY)
            else:
                print("detlogp: no /usr/local/cuda/bin/nvcc: building the CPU ops only")


class SdistWithSources(sdist):
    """Puts the libraries' sources in the sdist (ops_src/), so that a wheel
    builds from the sdist alone."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = _source_root([*CPU_SOURCES, *CLIENT_SOURCES, *CLIENT_PROTOS])
        target = pathlib.Path(base_dir) / SDIST_SOURCES
        names = {*CPU_SOURCES, *CLIENT_SOURCES, *CLIENT_PROTOS}
        for folder in HEADER_DIRS + CLIENT_HEADER_DIRS:
            names.update(str(p.relative_to(root)) for p in (root / folder).glob("*.h"))
        for name in sorted(names):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, target / name)


class BinaryDistribution(Distribution):
    """The wheel holds a compiled library: tag it for this platform."""

    def has_ext_modules(self):
        return _mode() != "none" or _client_mode() != "none"


setup(
    cmdclass={"build_py": BuildPyWithOps, "sdist": SdistWithSources},
    distclass=BinaryDistribution,
)
