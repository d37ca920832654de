// Minimal cp.async (sm_80+) helpers: 16-byte global->shared copies that run
// while the warp computes, so tile loads overlap the FFMA loop.
#ifndef DETLOGP_KERNELS_CUDA_PROJECTION_CP_ASYNC_CUH_
#define DETLOGP_KERNELS_CUDA_PROJECTION_CP_ASYNC_CUH_

namespace detlogp::kernels::cuda_detail {

// Copies 16 bytes, or writes 16 zero bytes when !valid (src is not read).
__device__ __forceinline__ void CpAsync16(float* smem_dst, const float* src,
                                          bool valid) {
  const unsigned dst =
      static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace detlogp::kernels::cuda_detail

#endif  // DETLOGP_KERNELS_CUDA_PROJECTION_CP_ASYNC_CUH_
