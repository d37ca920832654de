// The portable linear-logp kernel's translation unit: its split kernel and
// its own copy of the combine kernel, built for sm_80, sm_86, sm_89 and sm_90
// machine code and compute_80 PTX (kernels/cuda/BUILD). Nothing here is
// sm_90a, so every cubin in this object's fatbin is one the portable kernel's
// determinism key can name (linear_logp_portable.h).
#include "kernels/cuda/linear_logp_portable.h"

#include <cuda_runtime.h>

#include "kernels/cuda/linear_logp_combine_kernel.cuh"
#include "kernels/cuda/linear_logp_portable_kernel.cuh"

namespace detlogp::kernels::cuda::portable_v1 {

cudaError_t PrepareKernels(LoadedCode* split_code) {
  cudaFuncAttributes attrs;
  // The combine first: both must have code for the device.
  if (cudaError_t e = cudaFuncGetAttributes(&attrs, combine::CombineKernel);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e =
          cudaFuncGetAttributes(&attrs, LinearLogpPortableSplitKernel);
      e != cudaSuccess) {
    return e;
  }
  split_code->binary_version = attrs.binaryVersion;
  split_code->ptx_version = attrs.ptxVersion;
  if (cudaError_t e = cudaFuncSetAttribute(
          LinearLogpPortableSplitKernel,
          cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      e != cudaSuccess) {
    return e;
  }
  // As much shared memory as the SM has, so kMinBlocksPerSm CTAs fit where
  // they can (a hint: GPUs with less run one).
  return cudaFuncSetAttribute(LinearLogpPortableSplitKernel,
                              cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared);
}

cudaError_t EnqueueSplitKernel(const KernelParams& params, unsigned grid,
                               cudaStream_t stream) {
  LinearLogpPortableSplitKernel<<<grid, kThreads, kSmemBytes, stream>>>(
      params);
  return cudaGetLastError();
}

cudaError_t EnqueueCombineKernel(const combine::CombineParams& params,
                                 int grid, int threads, cudaStream_t stream) {
  combine::CombineKernel<<<grid, threads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace detlogp::kernels::cuda::portable_v1
