// Builds the portable linear-logp kernel (linear_logp_portable_kernel.cuh)
// for every architecture issue #13 ships: sm_80, sm_86, sm_89, sm_90 machine
// code and compute_80 PTX (see the BUILD target's nvcc_flags). Nothing calls
// it yet: the target proves that the kernel uses no instruction newer than
// sm_80. The launcher (linear_logp_cuda.cu) still builds for sm_90a only.
#include "kernels/cuda/linear_logp_portable_kernel.cuh"

namespace detlogp::kernels::cuda::portable_v1 {

// The kernel's address, so that every architecture's code is emitted.
const void* PortableSplitKernelForArchCheck() {
  return reinterpret_cast<const void*>(&LinearLogpPortableSplitKernel);
}

}  // namespace detlogp::kernels::cuda::portable_v1
