// Forward SGEMM of the H3 video projection: Y[R,5376] = X[R,96] . W^T (+ b).
//
// Register-tiled FP32 SGEMM. A CTA of 256 threads owns a 128x128 output tile
// with all K = 96 staged in shared memory: X as [128 rows][96 (+4 pad)] and
// the pre-transposed weight Wt as [96][128]. Each thread owns 8x8 outputs and
// runs, per output, the contract's chain acc = fmaf(x[k], w[k], acc) for
// k = 0..95 in order (explicit fmaf: nvcc never reassociates it), then adds
// the bias once. No cross-thread reduction exists, so the bits equal the CPU
// path for any grid, tile order or row count.
//
// Variants (kMode below) differ only in how loads overlap the FFMA loop.
#ifndef DETLOGP_KERNELS_CUDA_PROJECTION_FORWARD_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_PROJECTION_FORWARD_KERNEL_CUH_

#include <cstdint>

#include "kernels/cuda/projection_cp_async.cuh"

namespace detlogp::kernels::cuda_detail {

inline constexpr int kFwdK = 96;
inline constexpr int kFwdN = 5376;
inline constexpr int kFwdBM = 128;
inline constexpr int kFwdBN = 128;
inline constexpr int kFwdThreads = 256;
inline constexpr int kFwdNTiles = kFwdN / kFwdBN;  // 42
inline constexpr int kFwdAStride = kFwdK + 4;  // pad: 16B-aligned, no conflicts
inline constexpr int kFwdStageFloats = kFwdBM * kFwdAStride + kFwdK * kFwdBN;
inline constexpr int kFwdStageBytes = kFwdStageFloats * 4;  // 100,352

// Issues the cp.async copies of k-half `half` (k in [48*half, 48*half + 48))
// of tile `tile` (row-tile major, 42 column tiles per row tile, so
// concurrently running CTAs share X rows in L2).
__device__ __forceinline__ void FwdLoadTileHalf(float* stage, const float* x,
                                                const float* wt, int64_t rows,
                                                int64_t tile, int half) {
  constexpr int kHalfK = kFwdK / 2;
  float* as = stage;
  float* bs = stage + kFwdBM * kFwdAStride;
  const int64_t m0 = (tile / kFwdNTiles) * kFwdBM;
  const int n0 = static_cast<int>(tile % kFwdNTiles) * kFwdBN;
  const int tid = threadIdx.x;
#pragma unroll 1  // address math is cheap; unrolled, it spills at 128 regs
  for (int i = 0; i < kFwdBM * kHalfK / 4 / kFwdThreads; ++i) {  // 6
    const int idx = tid + i * kFwdThreads;
    const int r = idx / (kHalfK / 4);
    const int c4 = idx % (kHalfK / 4) + half * (kHalfK / 4);
    const bool valid = m0 + r < rows;
    const float* src = valid ? x + (m0 + r) * kFwdK + c4 * 4 : x;
    CpAsync16(as + r * kFwdAStride + c4 * 4, src, valid);
  }
#pragma unroll 1
  for (int i = 0; i < kHalfK * kFwdBN / 4 / kFwdThreads; ++i) {  // 6
    const int idx = tid + i * kFwdThreads;
    const int k = idx / (kFwdBN / 4) + half * kHalfK;
    const int c4 = idx % (kFwdBN / 4);
    CpAsync16(bs + k * kFwdBN + c4 * 4, wt + k * kFwdN + n0 + c4 * 4, true);
  }
}

__device__ __forceinline__ void FwdLoadTile(float* stage, const float* x,
                                            const float* wt, int64_t rows,
                                            int64_t tile) {
  FwdLoadTileHalf(stage, x, wt, rows, tile, 0);
  FwdLoadTileHalf(stage, x, wt, rows, tile, 1);
}

// Thread (tx, ty) owns rows {ty*4+i, 64+ty*4+i} and columns
// {tx*4+j, 64+tx*4+j}: 16-byte shared loads and coalesced 16-byte stores.
// Runs the chain for k in [kBegin, kEnd), continuing acc.
template <int kBegin, int kEnd>
__device__ __forceinline__ void FwdAccumulate(const float* stage,
                                              float (&acc)[8][8]) {
  const float* as = stage;
  const float* bs = stage + kFwdBM * kFwdAStride;
  const int tx = threadIdx.x & 15;
  const int ty = threadIdx.x >> 4;
#pragma unroll
  for (int kk = kBegin; kk < kEnd; kk += 4) {
    float4 a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = (i < 4 ? 0 : 64) + ty * 4 + (i & 3);
      a[i] = *reinterpret_cast<const float4*>(as + r * kFwdAStride + kk);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float* brow = bs + (kk + s) * kFwdBN + tx * 4;
      const float4 b0 = *reinterpret_cast<const float4*>(brow);
      const float4 b1 = *reinterpret_cast<const float4*>(brow + 64);
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float av = s == 0   ? a[i].x
                         : s == 1 ? a[i].y
                         : s == 2 ? a[i].z
                                  : a[i].w;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av, bv[j], acc[i][j]);
      }
    }
  }
}

// y = acc + b (no bias: y = acc exactly), streamed 16-byte stores.
template <bool kHasBias>
__device__ __forceinline__ void FwdStore(const float (&acc)[8][8],
                                         const float* bias, float* y,
                                         int64_t rows, int64_t tile) {
  const int tx = threadIdx.x & 15;
  const int ty = threadIdx.x >> 4;
  const int64_t m0 = (tile / kFwdNTiles) * kFwdBM;
  const int n0 = static_cast<int>(tile % kFwdNTiles) * kFwdBN;
  float4 bias0 = make_float4(0.f, 0.f, 0.f, 0.f), bias1 = bias0;
  if constexpr (kHasBias) {
    bias0 = *reinterpret_cast<const float4*>(bias + n0 + tx * 4);
    bias1 = *reinterpret_cast<const float4*>(bias + n0 + 64 + tx * 4);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = m0 + (i < 4 ? 0 : 64) + ty * 4 + (i & 3);
    if (row >= rows) continue;
    float4 o0 = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    float4 o1 = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    if constexpr (kHasBias) {
      o0.x += bias0.x;
      o0.y += bias0.y;
      o0.z += bias0.z;
      o0.w += bias0.w;
      o1.x += bias1.x;
      o1.y += bias1.y;
      o1.z += bias1.z;
      o1.w += bias1.w;
    }
    float* yr = y + row * kFwdN + n0 + tx * 4;
    __stcs(reinterpret_cast<float4*>(yr), o0);  // streamed: keep L2 for X, W
    __stcs(reinterpret_cast<float4*>(yr + 64), o1);
  }
}

__device__ __forceinline__ void FwdZero(float (&acc)[8][8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  }
}

// kMode 1: single stage, 2 CTAs/SM. kMode 2: double-buffered persistent,
// 1 CTA/SM. kMode 3: single stage, 2 CTAs/SM, the tile lands in two k-halves
// and the first half's FFMAs run while the second half is in flight.
template <int kMode, bool kHasBias>
__global__ void __launch_bounds__(kFwdThreads, kMode == 2 ? 1 : 2)
    ProjectionForwardKernel(const float* __restrict__ x,
                            const float* __restrict__ wt,
                            const float* __restrict__ bias,
                            float* __restrict__ y, int64_t rows,
                            int64_t num_tiles) {
  extern __shared__ __align__(16) float smem[];
  int64_t tile = blockIdx.x;
  if (tile >= num_tiles) return;
  float acc[8][8];
  if constexpr (kMode == 1) {
    for (; tile < num_tiles; tile += gridDim.x) {
      FwdLoadTile(smem, x, wt, rows, tile);
      CpAsyncCommit();
      CpAsyncWait<0>();
      __syncthreads();
      FwdZero(acc);
      FwdAccumulate<0, kFwdK>(smem, acc);
      __syncthreads();  // the next load overwrites the stage
      FwdStore<kHasBias>(acc, bias, y, rows, tile);
    }
  } else if constexpr (kMode == 3) {
    for (; tile < num_tiles; tile += gridDim.x) {
      FwdLoadTileHalf(smem, x, wt, rows, tile, 0);
      CpAsyncCommit();
      FwdLoadTileHalf(smem, x, wt, rows, tile, 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
      __syncthreads();
      FwdZero(acc);
      FwdAccumulate<0, kFwdK / 2>(smem, acc);
      CpAsyncWait<0>();
      __syncthreads();
      FwdAccumulate<kFwdK / 2, kFwdK>(smem, acc);
      __syncthreads();  // the next load overwrites the stage
      FwdStore<kHasBias>(acc, bias, y, rows, tile);
    }
  } else {
    int stage = 0;
    FwdLoadTile(smem, x, wt, rows, tile);
    CpAsyncCommit();
    for (; tile < num_tiles; tile += gridDim.x) {
      const int64_t next = tile + gridDim.x;
      if (next < num_tiles) {
        FwdLoadTile(smem + (stage ^ 1) * kFwdStageFloats, x, wt, rows, next);
      }
      CpAsyncCommit();  // possibly empty: keeps the group count uniform
      CpAsyncWait<1>();
      __syncthreads();
      FwdZero(acc);
      FwdAccumulate<0, kFwdK>(smem + stage * kFwdStageFloats, acc);
      __syncthreads();  // stage is refilled by the next iteration's prefetch
      FwdStore<kHasBias>(acc, bias, y, rows, tile);
      stage ^= 1;
    }
  }
}

}  // namespace detlogp::kernels::cuda_detail

#endif  // DETLOGP_KERNELS_CUDA_PROJECTION_FORWARD_KERNEL_CUH_
