"""CUDA without rules_cuda: nvcc in a genrule, linked as a static archive.

nvcc is called through its real path (readlink -f): through the
/usr/local/cuda symlink it cannot find its own headers. Objects target
sm_90a (wgmma, setmaxnreg, TMA) unless a library names its own `gencode`
(PORTABLE_GENCODE: every GPU from Ampere on).
"""

# The Hopper kernels: wgmma, setmaxnreg and TMA exist on sm_90a alone.
HOPPER_GENCODE = ["-gencode=arch=compute_90a,code=sm_90a"]

# Code that uses nothing beyond sm_80 (mma.sync, ldmatrix, cp.async):
# machine code for Ampere (sm_80, sm_86; sm_80's also runs on sm_87), Ada
# (sm_89) and Hopper (sm_90), and compute_80 PTX that the driver JIT-compiles
# on newer GPUs (sm_100, sm_120, ...). kernels/cuda/kernel_kind.h's
# kPortableSassArchs must list the same machine code.
PORTABLE_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_86,code=sm_86",
    "-gencode=arch=compute_89,code=sm_89",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_80,code=compute_80",
]

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-ffp-contract=off",
    # Warnings are errors: the host compiler's (as --copt=-Werror does for
    # the C++ targets, see .bazelrc) and nvcc's own.
    "-Xcompiler=-Wall",
    "-Xcompiler=-Werror",
    "-Werror=all-warnings",
    "-DSPDLOG_FMT_EXTERNAL",
    "--expt-relaxed-constexpr",
    "-I.",
]

def cuda_library(name, srcs, hdrs = [], textual_hdrs = [], deps = [], nvcc_flags = [], gencode = HOPPER_GENCODE, **kwargs):
    """A cc_library whose sources are .cu files compiled by nvcc.

    Args:
      name: target name.
      srcs: .cu files.
      hdrs: public headers (usable from C++).
      textual_hdrs: every other header the .cu files include (labels).
      deps: cc_library deps for linking.
      nvcc_flags: extra nvcc flags.
      gencode: the architectures to build for (HOPPER_GENCODE or
        PORTABLE_GENCODE).
      **kwargs: passed to cc_library.
    """
    # ".lo": Bazel links it whole (alwayslink), so static registrations such
    # as gtest cases in .cu files are kept.
    archive = "lib%s_device.lo" % name
    native.genrule(
        name = name + "_nvcc",
        srcs = srcs + hdrs + textual_hdrs,
        outs = [archive],
        cmd = " && ".join([
            "NVCC=$$(readlink -f /usr/local/cuda/bin/nvcc)",
            # A private temp dir per action: nvcc names its temp files after
            # its PID, and in the sandbox's PID namespace two concurrent nvcc
            # runs share a PID and delete each other's files in /tmp.
            "OBJDIR=$$(mktemp -d)",
            "export TMPDIR=$$OBJDIR",
            "for src in %s; do $$NVCC %s --objdir-as-tempdir -c $$src -o $$OBJDIR/$$(basename $$src).o || exit 1; done" % (
                " ".join(["$(location %s)" % s for s in srcs]),
                " ".join(NVCC_FLAGS + gencode + nvcc_flags),
            ),
            "$$NVCC -lib $$OBJDIR/*.o -o $@",
            "rm -rf $$OBJDIR",
        ]),
        message = "nvcc %s" % name,
    )
    native.cc_library(
        name = name,
        srcs = [archive],
        hdrs = hdrs,
        deps = deps + ["//third_party:cudart"],
        linkstatic = 1,
        alwayslink = 1,
        **kwargs
    )

def cuda_gpu_test(name, textual_hdrs = [], deps = [], size = "large"):
    """A gtest binary from `<name>.cu`, tagged "gpu": built everywhere (CI
    compiles it), run only where a GPU is (tools/device scripts).

    Args:
      name: test name; the source is name + ".cu".
      textual_hdrs: headers the .cu includes (labels).
      deps: cc_library deps.
      size: the test's size.
    """
    cuda_library(
        name = name + "_lib",
        testonly = True,
        srcs = [name + ".cu"],
        textual_hdrs = textual_hdrs,
        deps = deps,
    )
    native.cc_test(
        name = name,
        size = size,
        tags = ["gpu"],
        # Static against the project's libraries, so the binary copied into a
        # tools/device bundle loads no bazel-bin/_solib_k8 library.
        linkstatic = 1,
        deps = [
            ":" + name + "_lib",
            "//third_party:gtest_main",
        ],
    )
