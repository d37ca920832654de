// Forward variant "wide": 128x256 CTA tiles, 8x16 outputs per thread, the
// 96x256 weight tile resident in shared memory while the CTA walks a
// contiguous range of tiles (column-tile major), X tiles double-buffered with
// cp.async. One CTA per SM (200 KB of shared memory). Per output the chain is
// the contract's acc = fmaf(x[k], w[k], acc), k = 0..95, then + bias: the same
// bits as every other variant and the CPU.
#ifndef DETLOGP_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_KERNEL_CUH_

#include <cstdint>

#include "kernels/cuda/projection_cp_async.cuh"
#include "kernels/cuda/projection_forward_kernel.cuh"

namespace detlogp::kernels::cuda_detail {

inline constexpr int kWideBN = 256;
inline constexpr int kWideNTiles = kFwdN / kWideBN;  // 21
inline constexpr int kWideXFloats = kFwdBM * kFwdAStride;
inline constexpr int kWideWFloats = kFwdK * kWideBN;
inline constexpr int kWideSmemBytes = (kWideWFloats + 2 * kWideXFloats) * 4;

__device__ __forceinline__ void WideLoadX(float* xs, const float* x,
                                          int64_t rows, int64_t m_tile) {
  const int64_t m0 = m_tile * kFwdBM;
#pragma unroll 1
  for (int i = 0; i < kFwdBM * kFwdK / 4 / kFwdThreads; ++i) {  // 12
    const int idx = threadIdx.x + i * kFwdThreads;
    const int r = idx / (kFwdK / 4), c4 = idx % (kFwdK / 4);
    const bool valid = m0 + r < rows;
    CpAsync16(xs + r * kFwdAStride + c4 * 4,
              valid ? x + (m0 + r) * kFwdK + c4 * 4 : x, valid);
  }
}

__device__ __forceinline__ void WideLoadW(float* ws, const float* wt,
                                          int n_tile) {
  const int n0 = n_tile * kWideBN;
#pragma unroll 1
  for (int i = 0; i < kFwdK * kWideBN / 4 / kFwdThreads; ++i) {  // 24
    const int idx = threadIdx.x + i * kFwdThreads;
    const int k = idx / (kWideBN / 4), c4 = idx % (kWideBN / 4);
    CpAsync16(ws + k * kWideBN + c4 * 4, wt + k * kFwdN + n0 + c4 * 4, true);
  }
}

// Thread (tx, ty): rows {ty*4+i, 64+ty*4+i}, columns {64q + tx*4 + j}.
template <bool kHasBias>
__device__ __forceinline__ void WideTile(const float* xs, const float* ws,
                                         const float* bias, float* y,
                                         int64_t rows, int64_t m_tile,
                                         int n_tile) {
  const int tx = threadIdx.x & 15;
  const int ty = threadIdx.x >> 4;
  float acc[8][16];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 16; ++j) acc[i][j] = 0.f;
  }
#pragma unroll 2
  for (int kk = 0; kk < kFwdK; kk += 4) {
    float4 a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = (i < 4 ? 0 : 64) + ty * 4 + (i & 3);
      a[i] = *reinterpret_cast<const float4*>(xs + r * kFwdAStride + kk);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float* brow = ws + (kk + s) * kWideBN + tx * 4;
      float bv[16];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 b = *reinterpret_cast<const float4*>(brow + 64 * q);
        bv[4 * q] = b.x;
        bv[4 * q + 1] = b.y;
        bv[4 * q + 2] = b.z;
        bv[4 * q + 3] = b.w;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float av = s == 0   ? a[i].x
                         : s == 1 ? a[i].y
                         : s == 2 ? a[i].z
                                  : a[i].w;
#pragma unroll
        for (int j = 0; j < 16; ++j) acc[i][j] = fmaf(av, bv[j], acc[i][j]);
      }
    }
  }
  __syncthreads();  // all reads of this X stage are done before it refills
  const int64_t m0 = m_tile * kFwdBM;
  const int n0 = n_tile * kWideBN;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float4 bq = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (kHasBias) {
      bq = *reinterpret_cast<const float4*>(bias + n0 + 64 * q + tx * 4);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t row = m0 + (i < 4 ? 0 : 64) + ty * 4 + (i & 3);
      if (row >= rows) continue;
      float4 o = make_float4(acc[i][4 * q], acc[i][4 * q + 1],
                             acc[i][4 * q + 2], acc[i][4 * q + 3]);
      if constexpr (kHasBias) {  // y = acc + b; no bias: y = acc exactly
        o.x += bq.x;
        o.y += bq.y;
        o.z += bq.z;
        o.w += bq.w;
      }
      __stcs(reinterpret_cast<float4*>(y + row * kFwdN + n0 + 64 * q + tx * 4),
             o);
    }
  }
}

// Tiles t in [0, 21 * m_tiles), t -> (n = t / m_tiles, m = t % m_tiles);
// CTA b takes the contiguous range [b*T/G, (b+1)*T/G): balanced to one tile,
// and the weight tile is reloaded only when n changes (about once per CTA).
template <bool kHasBias>
__global__ void __launch_bounds__(kFwdThreads, 1)
    ProjectionForwardWideKernel(const float* __restrict__ x,
                                const float* __restrict__ wt,
                                const float* __restrict__ bias,
                                float* __restrict__ y, int64_t rows,
                                int64_t m_tiles) {
  extern __shared__ __align__(16) float smem[];
  float* ws = smem;
  float* xs = smem + kWideWFloats;  // two stages
  const int64_t total = m_tiles * kWideNTiles;
  int64_t t = total * blockIdx.x / gridDim.x;
  const int64_t t_end = total * (blockIdx.x + 1) / gridDim.x;
  if (t >= t_end) return;
  int n_cur = static_cast<int>(t / m_tiles);
  WideLoadW(ws, wt, n_cur);
  WideLoadX(xs, x, rows, t % m_tiles);
  CpAsyncCommit();
  int stage = 0;
  for (; t < t_end; ++t) {
    const int64_t next = t + 1;
    const bool same_n = next < t_end && next / m_tiles == n_cur;
    if (same_n) {
      WideLoadX(xs + (stage ^ 1) * kWideXFloats, x, rows, next % m_tiles);
    }
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    WideTile<kHasBias>(xs + stage * kWideXFloats, ws, bias, y, rows,
                       t % m_tiles, n_cur);  // ends with a barrier
    if (next < t_end && !same_n) {           // column tile changes: new W and X
      n_cur = static_cast<int>(next / m_tiles);
      WideLoadW(ws, wt, n_cur);
      WideLoadX(xs + (stage ^ 1) * kWideXFloats, x, rows, next % m_tiles);
      CpAsyncCommit();
    }
    stage ^= 1;
  }
}

}  // namespace detlogp::kernels::cuda_detail

#endif  // DETLOGP_KERNELS_CUDA_PROJECTION_FORWARD_WIDE_KERNEL_CUH_
