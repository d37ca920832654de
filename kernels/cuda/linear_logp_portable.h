// Host entry points into the portable linear-logp kernel's translation unit
// (linear_logp_portable.cu). That file is built for every architecture the
// portable kernel ships for (sm_80, sm_86, sm_89, sm_90 machine code and
// compute_80 PTX), apart from the Hopper kernel's sm_90a translation unit,
// so each fatbin holds unambiguous code; LinearLogpCuda (linear_logp_cuda.cu)
// dispatches here for KernelKind::kPortable. Internal to kernels/cuda: use
// LinearLogpCuda.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_H_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_H_

#include <cuda_runtime_api.h>

#include "kernels/cuda/linear_logp_combine_params.h"
#include "kernels/cuda/linear_logp_portable_params.cuh"

namespace detlogp::kernels::cuda::portable_v1 {

// The code the driver loaded for this kernel on a device
// (cudaFuncAttributes): binary_version is the cubin's architecture (e.g. 80
// for sm_80 SASS running on an sm_86 device; the device's own CC when the
// driver JIT-compiled the PTX), ptx_version the PTX's virtual architecture.
struct LoadedCode {
  int binary_version = 0;
  int ptx_version = 0;
};

// On the current device: loads the split and combine kernels (the first call
// may JIT-compile the PTX), raises each split kernel variant's dynamic
// shared memory (those that fit in smem_optin_bytes, the device's
// cudaDevAttrMaxSharedMemoryPerBlockOptin) and reports the split kernel's
// code. An error when this build has no code the device can run.
cudaError_t PrepareKernels(int smem_optin_bytes, LoadedCode* split_code);

// Enqueues the split pass: picks the tiling for the batch's rows, extras and
// the device's shared memory (the same smem_optin_bytes as PrepareKernels),
// and launches one CTA per (row block, split). params.num_row_blocks is
// the tiling's.
cudaError_t EnqueueSplitKernel(KernelParams params, int smem_optin_bytes,
                               cudaStream_t stream);

// Enqueues this translation unit's copy of the combine (its top-k variant
// when params.top_ids is set).
cudaError_t EnqueueCombineKernel(const combine::CombineParams& params,
                                 cudaStream_t stream);

}  // namespace detlogp::kernels::cuda::portable_v1

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_H_
