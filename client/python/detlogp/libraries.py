"""Finding and loading the project's shared libraries.

The package's native code comes as shared libraries with small C ABIs:
libdetlogp_ops.so and libdetlogp_ops_cuda.so (the server's kernels, for
detlogp.ops and detlogp.torch; kernels/capi/detlogp_ops.h and
detlogp_ops_cuda.h) and libdetlogp_client.so (the C++ client, for
detlogp.engine). Each is found, in order, at its environment variable
($DETLOGP_OPS_LIBRARY, $DETLOGP_OPS_CUDA_LIBRARY, $DETLOGP_CLIENT_LIBRARY),
in the installed package (detlogp/_lib/: `pip install ./client/python`
compiles the CPU ops library there, and with DETLOGP_BUILD_OPS=1 also the
CUDA one, see client/python/README.md), else under bazel-bin/ in the working
directory or a folder above it. Libraries are loaded on first use, so the
package imports without them; a missing one raises RuntimeError naming what
is missing and how to get it.

This module loads the ops libraries and declares their C signatures;
detlogp.engine loads the client library with find_library_file.
"""

import ctypes
import os
import pathlib
import threading

__all__ = [
    "PACKAGE_LIB_DIR",
    "find_library_file",
    "LIBRARY_ENV",
    "CUDA_LIBRARY_ENV",
    "find_library",
    "find_cuda_library",
    "load_library",
    "load_cuda_library",
    "cuda_available",
    "ERROR_BUFFER_BYTES",
    "UINT16_POINTER",
    "FLOAT_POINTER",
    "INT32_POINTER",
]

# Where `pip install ./client/python` puts the libraries it compiles.
PACKAGE_LIB_DIR = pathlib.Path(__file__).resolve().parent / "_lib"
LIBRARY_ENV = "DETLOGP_OPS_LIBRARY"
CUDA_LIBRARY_ENV = "DETLOGP_OPS_CUDA_LIBRARY"
_LIBRARY_PATH = pathlib.Path("bazel-bin") / "kernels" / "capi" / "libdetlogp_ops.so"
_CUDA_LIBRARY_PATH = pathlib.Path("bazel-bin") / "kernels" / "capi" / "libdetlogp_ops_cuda.so"
# The C ABI versions this package was written against; a library of another
# version was built from another checkout and is refused.
_ABI_VERSION = 2
_CUDA_ABI_VERSION = 3
# Size of the message buffer every C ABI call fills on failure.
ERROR_BUFFER_BYTES = 1024

UINT16_POINTER = ctypes.POINTER(ctypes.c_uint16)
FLOAT_POINTER = ctypes.POINTER(ctypes.c_float)
INT32_POINTER = ctypes.POINTER(ctypes.c_int32)
_i64 = ctypes.c_int64

_lock = threading.Lock()
_lib = None
_cuda_lib = None


def find_library_file(env_name, relative, start=None):
    """A library of the project's: $`env_name`, else its name in the
    installed package's library folder, else `relative` (a bazel-bin path)
    in `start` (or the working directory) or a folder above it; None if not
    found."""
    env = os.environ.get(env_name)
    if env:
        return pathlib.Path(env)
    packaged = PACKAGE_LIB_DIR / relative.name
    if packaged.exists():
        return packaged
    here = pathlib.Path(start or os.getcwd()).resolve()
    for folder in [here, *here.parents]:
        candidate = folder / relative
        if candidate.exists():
            return candidate
    return None


def find_library(start=None):
    """$DETLOGP_OPS_LIBRARY, else detlogp/_lib/libdetlogp_ops.so in the
    installed package, else bazel-bin/kernels/capi/libdetlogp_ops.so in
    `start` (or the working directory) or any folder above it; None if not
    found."""
    return find_library_file(LIBRARY_ENV, _LIBRARY_PATH, start)


def find_cuda_library(start=None):
    """As find_library, for libdetlogp_ops_cuda.so ($DETLOGP_OPS_CUDA_LIBRARY)."""
    return find_library_file(CUDA_LIBRARY_ENV, _CUDA_LIBRARY_PATH, start)


def load_library():
    """The loaded ctypes library (loaded once); RuntimeError naming what is
    missing when it cannot be found or loaded."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = find_library()
        if path is None:
            raise RuntimeError(
                f"detlogp.ops needs the CPU ops library libdetlogp_ops.so, which "
                f"this installation lacks (installed with DETLOGP_BUILD_OPS=0?): "
                f"reinstall with `pip install ./client/python` (it compiles the "
                f"library), or set ${LIBRARY_ENV} to its path, or run `bazel build "
                f"//kernels/capi:libdetlogp_ops.so` in the detlogp repository and "
                f"work from inside it (looked in {PACKAGE_LIB_DIR} and for "
                f"{_LIBRARY_PATH} in {pathlib.Path.cwd()} and every folder above)"
            )
        if not path.exists():
            raise RuntimeError(
                f"detlogp.ops: ${LIBRARY_ENV}={path} does not exist "
                "(build it with `bazel build "
                "//kernels/capi:libdetlogp_ops.so`)"
            )
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise RuntimeError(f"detlogp.ops: cannot load {path}: {error}") from None
        lib.detlogp_ops_abi_version.restype = ctypes.c_int
        lib.detlogp_ops_abi_version.argtypes = []
        if lib.detlogp_ops_abi_version() != _ABI_VERSION:
            raise RuntimeError(
                f"detlogp.ops: {path} has C ABI version "
                f"{lib.detlogp_ops_abi_version()}, this package wants {_ABI_VERSION} "
                "(rebuild the library from the same checkout as the package)"
            )
        lib.detlogp_cpu_linear_logp.restype = ctypes.c_int
        lib.detlogp_cpu_linear_logp.argtypes = [
            UINT16_POINTER,
            _i64,
            _i64,
            FLOAT_POINTER,
            _i64,
            UINT16_POINTER,
            _i64,
            INT32_POINTER,
            FLOAT_POINTER,
            ctypes.c_int,
            FLOAT_POINTER,
            FLOAT_POINTER,
            FLOAT_POINTER,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.detlogp_cpu_h3_projection.restype = ctypes.c_int
        lib.detlogp_cpu_h3_projection.argtypes = [
            FLOAT_POINTER,
            _i64,
            FLOAT_POINTER,
            FLOAT_POINTER,
            ctypes.c_int,
            FLOAT_POINTER,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        for name in ("detlogp_cpu_h3_projection_input_grad",):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [
                FLOAT_POINTER,
                FLOAT_POINTER,
                _i64,
                ctypes.c_int,
                FLOAT_POINTER,
                ctypes.c_char_p,
                ctypes.c_size_t,
            ]
        lib.detlogp_cpu_h3_projection_weight_grad.restype = ctypes.c_int
        lib.detlogp_cpu_h3_projection_weight_grad.argtypes = [
            FLOAT_POINTER,
            FLOAT_POINTER,
            _i64,
            _i64,
            ctypes.c_int,
            FLOAT_POINTER,
            FLOAT_POINTER,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.detlogp_cpu_determinism_key.restype = ctypes.c_int
        lib.detlogp_cpu_determinism_key.argtypes = [
            UINT16_POINTER,
            _i64,
            _i64,
            FLOAT_POINTER,
            _i64,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        _lib = lib
        return lib


_vp = ctypes.c_void_p
_CUDA_SIGNATURES = {
    "detlogp_cuda_check_device": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "detlogp_cuda_lm_head_create": (
        ctypes.c_int,
        [
            _vp,
            _i64,
            _i64,
            _vp,
            _i64,
            ctypes.c_int,
            ctypes.POINTER(_vp),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ],
    ),
    "detlogp_cuda_lm_head_destroy": (None, [_vp]),
    "detlogp_cuda_linear_logp_workspace_bytes": (_i64, [_vp, _i64, ctypes.c_int]),
    "detlogp_cuda_linear_logp": (
        ctypes.c_int,
        [
            _vp,
            _vp,
            _i64,
            _vp,
            ctypes.c_int,
            _vp,
            ctypes.c_float,
            _vp,
            _vp,
            _vp,
            _vp,
            ctypes.c_size_t,
            _vp,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ],
    ),
    "detlogp_cuda_linear_logp_backward_workspace_bytes": (
        _i64,
        [_vp, _i64, ctypes.c_int, ctypes.c_int],
    ),
    "detlogp_cuda_linear_logp_backward": (
        ctypes.c_int,
        [
            _vp,
            _vp,
            _i64,
            _vp,
            ctypes.c_int,
            _vp,
            ctypes.c_float,
            _vp,
            _vp,
            _vp,
            _vp,
            _vp,
            _vp,
            ctypes.c_int,
            _vp,
            ctypes.c_int,
            _vp,
            _vp,
            ctypes.c_size_t,
            _vp,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ],
    ),
    "detlogp_cuda_h3_projection_forward_workspace_bytes": (_i64, []),
    "detlogp_cuda_h3_projection_forward": (
        ctypes.c_int,
        [
            _vp,
            _i64,
            _vp,
            _vp,
            _vp,
            _vp,
            ctypes.c_size_t,
            ctypes.c_int,
            _vp,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ],
    ),
    "detlogp_cuda_h3_projection_input_grad_workspace_bytes": (_i64, [_i64]),
    "detlogp_cuda_h3_projection_input_grad": (
        ctypes.c_int,
        [
            _vp,
            _i64,
            _vp,
            _vp,
            _vp,
            ctypes.c_size_t,
            ctypes.c_int,
            _vp,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ],
    ),
    "detlogp_cuda_h3_projection_weight_grad_workspace_bytes": (_i64, [_i64, _i64]),
    "detlogp_cuda_h3_projection_weight_grad": (
        ctypes.c_int,
        [
            _vp,
            _vp,
            _i64,
            _i64,
            _vp,
            _vp,
            _vp,
            ctypes.c_size_t,
            ctypes.c_int,
            _vp,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ],
    ),
    "detlogp_cuda_determinism_key": (
        ctypes.c_int,
        [
            UINT16_POINTER,
            _i64,
            _i64,
            FLOAT_POINTER,
            _i64,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ],
    ),
    "detlogp_cuda_device_determinism_key": (
        ctypes.c_int,
        [
            ctypes.c_int,
            UINT16_POINTER,
            _i64,
            _i64,
            FLOAT_POINTER,
            _i64,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ],
    ),
}


def load_cuda_library():
    """The loaded ctypes CUDA library (loaded once); RuntimeError naming what
    is missing when it cannot be found or loaded. Loading needs the CUDA
    runtime (libcudart.so.13), not a GPU."""
    global _cuda_lib
    if _cuda_lib is not None:
        return _cuda_lib
    with _lock:
        if _cuda_lib is not None:
            return _cuda_lib
        path = find_cuda_library()
        if path is None:
            raise RuntimeError(
                "detlogp.ops on CUDA needs the CUDA ops library "
                f"libdetlogp_ops_cuda.so, which is not installed: on a machine with "
                f"the CUDA toolkit, run `DETLOGP_BUILD_OPS=1 pip install "
                f"./client/python[ops]` (see client/python/README.md), or `bazel "
                f"build //kernels/capi:libdetlogp_ops_cuda.so` in the detlogp "
                f"repository and work from inside it, or set ${CUDA_LIBRARY_ENV} "
                f"(looked in {PACKAGE_LIB_DIR} and for {_CUDA_LIBRARY_PATH} in "
                f"{pathlib.Path.cwd()} and every folder above)"
            )
        if not path.exists():
            raise RuntimeError(
                f"detlogp.ops: ${CUDA_LIBRARY_ENV}={path} does not "
                "exist (build it with `bazel build "
                "//kernels/capi:libdetlogp_ops_cuda.so`)"
            )
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise RuntimeError(
                f"detlogp.ops: cannot load the CUDA ops library {path}: {error} "
                "(it needs the CUDA 13 runtime libcudart.so.13 and the libraries "
                "it was built against on the loader's path)"
            ) from None
        lib.detlogp_ops_cuda_abi_version.restype = ctypes.c_int
        lib.detlogp_ops_cuda_abi_version.argtypes = []
        if lib.detlogp_ops_cuda_abi_version() != _CUDA_ABI_VERSION:
            raise RuntimeError(
                f"detlogp.ops: {path} has CUDA C ABI version "
                f"{lib.detlogp_ops_cuda_abi_version()}, this package wants "
                f"{_CUDA_ABI_VERSION} (rebuild it from the same checkout)"
            )
        for name, (restype, argtypes) in _CUDA_SIGNATURES.items():
            function = getattr(lib, name)
            function.restype = restype
            function.argtypes = argtypes
        _cuda_lib = lib
        return lib


# Devices cuda_available found usable: each is checked once.
_usable_devices = set()


def cuda_available(device=0):
    """(True, "") when the CUDA ops can run on cuda:`device`, else (False, what
    is missing): the library, PyTorch, or a GPU of compute capability >= 8.0."""
    if int(device) in _usable_devices:
        return True, ""
    try:
        lib = load_cuda_library()
    except RuntimeError as error:
        return False, str(error)
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    if lib.detlogp_cuda_check_device(int(device), error, ERROR_BUFFER_BYTES) != 0:
        return False, "detlogp.ops on CUDA: " + error.value.decode(errors="replace")
    _usable_devices.add(int(device))
    return True, ""
