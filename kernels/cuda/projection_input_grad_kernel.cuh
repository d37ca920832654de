// dX[R,96] = dY[R,5376] . W[5376,96] on the GPU, in the order fixed by
// kernels/projection_grad.h: per output, 42 chunks of 128 terms; each chunk a
// sequential fma chain from +0, the chunk partials added to a running total
// in ascending chunk order. Bit-equal to ProjectionInputGrad (CPU).
//
// A CTA of 256 threads owns 128 rows x all 96 outputs and walks K in tiles of
// 64 (two tiles per 128-term chunk), double-buffered with cp.async: dY as
// [128][64 (+4 pad)], W as [64][96]. Each thread owns 8 rows x 6 columns.
#ifndef DETLOGP_KERNELS_CUDA_PROJECTION_INPUT_GRAD_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_PROJECTION_INPUT_GRAD_KERNEL_CUH_

#include <cstdint>

#include "kernels/cuda/projection_cp_async.cuh"

namespace detlogp::kernels::cuda_detail {

inline constexpr int kDxK = 5376;  // reduction length
inline constexpr int kDxN = 96;    // outputs per row
inline constexpr int kDxBM = 128;
inline constexpr int kDxBK = 64;
inline constexpr int kDxChunk = 128;  // must match kInputGradChunk
inline constexpr int kDxThreads = 256;
inline constexpr int kDxAStride = kDxBK + 4;
inline constexpr int kDxStageFloats = kDxBM * kDxAStride + kDxBK * kDxN;
inline constexpr int kDxStageBytes = kDxStageFloats * 4;  // 59,392
inline constexpr int kDxKTiles = kDxK / kDxBK;            // 84

__device__ __forceinline__ void DxLoadTile(float* stage, const float* dy,
                                           const float* w, int64_t rows,
                                           int64_t m0, int kt) {
  float* as = stage;
  float* bs = stage + kDxBM * kDxAStride;
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < kDxBM * kDxBK / 4 / kDxThreads; ++i) {  // 8
    const int idx = tid + i * kDxThreads;
    const int r = idx / (kDxBK / 4);
    const int c4 = idx % (kDxBK / 4);
    const bool valid = m0 + r < rows;
    const float* src =
        valid ? dy + (m0 + r) * kDxK + kt * kDxBK + c4 * 4 : dy;
    CpAsync16(as + r * kDxAStride + c4 * 4, src, valid);
  }
#pragma unroll
  for (int i = 0; i < kDxBK * kDxN / 4 / kDxThreads; ++i) {  // 6
    const int idx = tid + i * kDxThreads;
    const int k = idx / (kDxN / 4);
    const int c4 = idx % (kDxN / 4);
    CpAsync16(bs + k * kDxN + c4 * 4,
              w + static_cast<int64_t>(kt * kDxBK + k) * kDxN + c4 * 4, true);
  }
}

// Thread (tx, ty): rows {ty*4+i, 64+ty*4+i}, columns {tx*2, tx*2+1} + {0,32,64}.
__global__ void __launch_bounds__(kDxThreads, 1)
    ProjectionInputGradKernel(const float* __restrict__ dy,
                              const float* __restrict__ w,
                              float* __restrict__ dx, int64_t rows) {
  extern __shared__ __align__(16) float smem[];
  const int tx = threadIdx.x & 15;
  const int ty = threadIdx.x >> 4;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kDxBM;
  float total[8][6], part[8][6];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 6; ++j) total[i][j] = part[i][j] = 0.f;
  }
  DxLoadTile(smem, dy, w, rows, m0, 0);
  CpAsyncCommit();
  for (int kt = 0; kt < kDxKTiles; ++kt) {
    if (kt + 1 < kDxKTiles) {
      DxLoadTile(smem + ((kt + 1) & 1) * kDxStageFloats, dy, w, rows, m0,
                 kt + 1);
    }
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    const float* as = smem + (kt & 1) * kDxStageFloats;
    const float* bs = as + kDxBM * kDxAStride;
#pragma unroll
    for (int kk = 0; kk < kDxBK; kk += 4) {
      float4 a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = (i < 4 ? 0 : 64) + ty * 4 + (i & 3);
        a[i] = *reinterpret_cast<const float4*>(as + r * kDxAStride + kk);
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const float* brow = bs + (kk + s) * kDxN + tx * 2;
        const float2 b0 = *reinterpret_cast<const float2*>(brow);
        const float2 b1 = *reinterpret_cast<const float2*>(brow + 32);
        const float2 b2 = *reinterpret_cast<const float2*>(brow + 64);
        const float bv[6] = {b0.x, b0.y, b1.x, b1.y, b2.x, b2.y};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float av = s == 0 ? a[i].x : s == 1 ? a[i].y
                         : s == 2 ? a[i].z : a[i].w;
#pragma unroll
          for (int j = 0; j < 6; ++j) part[i][j] = fmaf(av, bv[j], part[i][j]);
        }
      }
    }
    if ((kt + 1) % (kDxChunk / kDxBK) == 0) {  // a 128-term chunk is done
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 6; ++j) {
          total[i][j] = total[i][j] + part[i][j];
          part[i][j] = 0.f;
        }
      }
    }
    __syncthreads();  // this stage is refilled two iterations on
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = m0 + (i < 4 ? 0 : 64) + ty * 4 + (i & 3);
    if (row >= rows) continue;
    float* out = dx + row * kDxN + tx * 2;
#pragma unroll
    for (int g = 0; g < 3; ++g) {
      *reinterpret_cast<float2*>(out + 32 * g) =
          make_float2(total[i][2 * g], total[i][2 * g + 1]);
    }
  }
}

}  // namespace detlogp::kernels::cuda_detail

#endif  // DETLOGP_KERNELS_CUDA_PROJECTION_INPUT_GRAD_KERNEL_CUH_
