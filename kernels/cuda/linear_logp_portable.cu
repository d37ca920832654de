// The portable linear-logp kernel's translation unit: its split kernel (every
// tiling and extras variant) and its own copy of the combine kernel, built
// for sm_80, sm_86, sm_89 and sm_90 machine code and compute_80 PTX
// (kernels/cuda/BUILD). Nothing here is sm_90a, so every cubin in this
// object's fatbin is one the portable kernel's determinism key can name
// (linear_logp_portable.h).
#include "kernels/cuda/linear_logp_portable.h"

#include <cuda_runtime.h>

#include "kernels/cuda/linear_logp_combine_kernel.cuh"
#include "kernels/cuda/linear_logp_portable_kernel.cuh"

namespace detlogp::kernels::cuda::portable_v1 {
namespace {

using SplitKernel = void (*)(KernelParams);

template <class T, bool kTopK>
SplitKernel Variant(bool entropy) {
  return entropy ? LinearLogpPortableSplitKernel<T, true, kTopK>
                 : LinearLogpPortableSplitKernel<T, false, kTopK>;
}

// Dynamic shared memory and the carveout for one kernel: as much shared
// memory as the SM has, so kMinBlocksPerSm CTAs fit where they can (a hint:
// GPUs with less run one).
cudaError_t Configure(SplitKernel kernel, int smem_bytes) {
  if (cudaError_t e = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
      e != cudaSuccess) {
    return e;
  }
  return cudaFuncSetAttribute(kernel,
                              cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared);
}

// A tiling's variants with and without entropy.
template <class T, bool kTopK>
cudaError_t ConfigureTiling() {
  for (const bool entropy : {false, true}) {
    if (cudaError_t e = Configure(Variant<T, kTopK>(entropy), T::kSmemBytes);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

struct Launch {
  SplitKernel kernel;
  int threads;
  int smem_bytes;
  int block_rows;
};

template <class T, bool kTopK>
Launch LaunchOf(bool entropy) {
  return Launch{Variant<T, kTopK>(entropy), T::kThreads, T::kSmemBytes,
                T::kBlockM};
}

// The deep tiling where the GPU has its shared memory, else the shallow one.
template <class Deep, class Shallow, bool kTopK = false>
Launch DeepOrShallowLaunch(bool entropy, int smem_optin_bytes) {
  return smem_optin_bytes >= Deep::kSmemBytes
             ? LaunchOf<Deep, kTopK>(entropy)
             : LaunchOf<Shallow, kTopK>(entropy);
}

// The tilings of one N range: the shallow one always, the deep one where it
// fits.
template <class Deep, class Shallow, bool kTopK = false>
cudaError_t ConfigureDeepOrShallow(int smem_optin_bytes) {
  if (cudaError_t e = ConfigureTiling<Shallow, kTopK>(); e != cudaSuccess) {
    return e;
  }
  if (smem_optin_bytes < Deep::kSmemBytes) return cudaSuccess;
  return ConfigureTiling<Deep, kTopK>();
}

// The tiling for a batch: top-k has its own; N <= 128 streams the weight
// through a deep ring and N > 256 takes 256-row blocks where the GPU has
// the shared memory.
Launch PickLaunch(const KernelParams& p, int smem_optin_bytes) {
  const bool entropy = p.split_mean_z != nullptr;
  if (p.top_k > 0) {
    if (p.rows <= TopKNarrowTiling::kBlockM) {
      return DeepOrShallowLaunch<TopKNarrowTiling, TopKNarrowShallowTiling,
                                 true>(entropy, smem_optin_bytes);
    }
    return LaunchOf<TopKTiling, true>(entropy);
  }
  if (p.rows <= Narrow16Tiling::kBlockM) {
    return DeepOrShallowLaunch<Narrow16Tiling, Narrow16ShallowTiling>(
        entropy, smem_optin_bytes);
  }
  if (p.rows <= Narrow32Tiling::kBlockM) {
    return DeepOrShallowLaunch<Narrow32Tiling, Narrow32ShallowTiling>(
        entropy, smem_optin_bytes);
  }
  if (p.rows <= Narrow64Tiling::kBlockM) {
    return DeepOrShallowLaunch<Narrow64Tiling, Narrow64ShallowTiling>(
        entropy, smem_optin_bytes);
  }
  if (p.rows <= Narrow128Tiling::kBlockM) {
    return DeepOrShallowLaunch<Narrow128Tiling, WideTiling>(entropy,
                                                            smem_optin_bytes);
  }
  if (p.rows <= 2 * WideTiling::kBlockM)
    return LaunchOf<WideTiling, false>(entropy);
  return DeepOrShallowLaunch<Wide256Tiling, WideTiling>(entropy,
                                                        smem_optin_bytes);
}

}  // namespace

cudaError_t PrepareKernels(int smem_optin_bytes, LoadedCode* split_code) {
  cudaFuncAttributes attrs;
  // The combines first: all must have code for the device.
  if (cudaError_t e = cudaFuncGetAttributes(&attrs, combine::CombineKernel);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = cudaFuncGetAttributes(&attrs, combine::CombineTopKKernel);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = cudaFuncGetAttributes(
          &attrs, LinearLogpPortableSplitKernel<WideTiling, false, false>);
      e != cudaSuccess) {
    return e;
  }
  split_code->binary_version = attrs.binaryVersion;
  split_code->ptx_version = attrs.ptxVersion;
  if (cudaError_t e =
          ConfigureDeepOrShallow<Narrow128Tiling, WideTiling>(smem_optin_bytes);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e =
          ConfigureDeepOrShallow<Wide256Tiling, WideTiling>(smem_optin_bytes);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = ConfigureTiling<TopKTiling, true>(); e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e =
          ConfigureDeepOrShallow<TopKNarrowTiling, TopKNarrowShallowTiling,
                                 true>(smem_optin_bytes);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e =
          ConfigureDeepOrShallow<Narrow16Tiling, Narrow16ShallowTiling>(
              smem_optin_bytes);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e =
          ConfigureDeepOrShallow<Narrow32Tiling, Narrow32ShallowTiling>(
              smem_optin_bytes);
      e != cudaSuccess) {
    return e;
  }
  return ConfigureDeepOrShallow<Narrow64Tiling, Narrow64ShallowTiling>(
      smem_optin_bytes);
}

cudaError_t EnqueueSplitKernel(KernelParams params, int smem_optin_bytes,
                               cudaStream_t stream) {
  const Launch launch = PickLaunch(params, smem_optin_bytes);
  params.num_row_blocks =
      (params.rows + launch.block_rows - 1) / launch.block_rows;
  const unsigned grid =
      static_cast<unsigned>(params.num_row_blocks * params.num_splits);
  launch.kernel<<<grid, launch.threads, launch.smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t EnqueueCombineKernel(const combine::CombineParams& params,
                                 cudaStream_t stream) {
  // Built for sm_80 on, where a programmatic dependent launch is not there.
  return combine::EnqueueCombineKernels(params, stream,
                                        /*dependent_launch=*/false);
}

}  // namespace detlogp::kernels::cuda::portable_v1
