// The one mma.sync shape the linear-logp kernels use (sm_80 on): the
// portable split kernel's logits and the Hopper launcher's top-k floor
// sample (linear_logp_floor_kernel.cuh).
#ifndef DETLOGP_KERNELS_CUDA_MMA_SYNC_CUH_
#define DETLOGP_KERNELS_CUDA_MMA_SYNC_CUH_

#include <cstdint>

namespace detlogp::kernels::cuda {

// d += a * b for one m16n8k16 fragment (bf16 in, fp32 accumulate).
__device__ __forceinline__ void MmaM16N8K16(float* d, const uint32_t* a,
                                            uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace detlogp::kernels::cuda

#endif  // DETLOGP_KERNELS_CUDA_MMA_SYNC_CUH_
