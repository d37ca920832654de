// Which linear-logp kernel runs on which GPU, and how the portable kernel's
// code is named in the determinism key. Plain C++ (no CUDA headers), so the
// server's kernel choice and the key's wording are tested on the CPU.
//
// Two kernels follow one contract (linear_logp_cuda.h) with different bits:
//   * kHopper (sm90a-wgmma-v3): wgmma + TMA, compute capability 9.0 only.
//   * kPortable (portable-mma-sync-v1): mma.sync + ldmatrix + cp.async, any
//     compute capability >= 8.0. Shipped as sm_80, sm_86, sm_89 and sm_90
//     machine code (SASS) plus compute_80 PTX, which the driver JIT-compiles
//     on GPUs with no SASS of their major version (sm_100, sm_120, ...).
// By default a GPU of compute capability 9.0 runs kHopper and every other GPU
// of compute capability >= 8.0 runs kPortable (DefaultKernelFor); the server
// and the trainer ops (kernels/capi) both use that rule, so their keys and
// bits agree.
#ifndef DETLOGP_KERNELS_CUDA_KERNEL_KIND_H_
#define DETLOGP_KERNELS_CUDA_KERNEL_KIND_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace detlogp::kernels::cuda {

enum class KernelKind {
  kHopper,    // sm90a-wgmma-v3: wgmma + TMA, compute capability 9.0 only
  kPortable,  // portable-mma-sync-v1: mma.sync + ldmatrix + cp.async, any
              // compute capability >= 8.0 (no entropy / top-k yet)
};

// "hopper" or "portable" (the server's --logp_kernel values).
const char* KernelKindName(KernelKind kernel);

// The architectures the portable kernel ships machine code for (major * 10 +
// minor, as cudaFuncAttributes::binaryVersion counts them), and the virtual
// architecture of its PTX. Must match kernels/cuda/BUILD's gencode flags.
inline constexpr int kPortableSassArchs[] = {80, 86, 89, 90};
inline constexpr int kPortablePtxArch = 80;

// The Hopper kernel's instruction set in the determinism key.
inline constexpr char kHopperInstructionSet[] = "sm_90a";

// kHopper on compute capability 9.0, kPortable on any other >= 8.0;
// FAILED_PRECONDITION below 8.0 (no kernel of this build runs there).
absl::StatusOr<KernelKind> DefaultKernelFor(int cc_major, int cc_minor);

// Whether `kernel` can run on a device of this compute capability.
bool KernelRunsOn(KernelKind kernel, int cc_major, int cc_minor);

// The instruction set of code built for PORTABLE_GENCODE (the portable
// linear-logp kernel, the H3 projection) for the determinism key: what the
// bits depend on besides the kernel version. binary_version and ptx_version
// are the loaded kernel's cudaFuncAttributes; driver_version is
// cudaDriverGetVersion's (e.g. 13000); shipped_sass is kPortableSassArchs.
//   * machine code shipped in the build (binary_version is one of
//     shipped_sass): "sm_86/sass_sm_80" names the device's compute
//     capability and the cubin the driver loaded (sm_80 SASS also runs on
//     sm_86, sm_87 and sm_89; which one ran is part of the bits).
//   * otherwise the driver JIT-compiled the PTX, and a different driver may
//     emit different code: "sm_120/jit_compute_80/driver_13000".
std::string PortableInstructionSet(int cc_major, int cc_minor,
                                   int binary_version, int ptx_version,
                                   int driver_version,
                                   absl::Span<const int> shipped_sass);

// The cubin the driver loads on a device of this compute capability when
// the build ships `shipped_sass` (the newest of the device's major version
// not newer than the device), or 0 when there is none and the PTX is
// JIT-compiled. For code whose cudaFuncAttributes are not at hand.
int BestShippedSass(int cc_major, int cc_minor,
                    absl::Span<const int> shipped_sass);

}  // namespace detlogp::kernels::cuda

#endif  // DETLOGP_KERNELS_CUDA_KERNEL_KIND_H_
