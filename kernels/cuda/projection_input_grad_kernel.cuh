// dX[R,96] = dY[R,5376] . W[5376,96] on the GPU, in the order fixed by
// kernels/projection_grad.h: per output, 42 chunks of 128 terms; each chunk a
// sequential fma chain from +0, the chunk partials added to a running total
// in ascending chunk order. Bit-equal to ProjectionInputGrad (CPU).
//
// A CTA of 256 threads owns 128 rows x all 96 outputs and walks K in tiles of
// 64 (two tiles per 128-term chunk), double-buffered with cp.async: dY as
// [128][64 (+4 pad)], W as [64][96]. Each thread owns 8 rows x 6 columns.
//
// Two modes (same bits):
//   kSplit = false: grid (row tiles); a CTA walks all 42 chunks and keeps the
//     running total in registers (large batches: enough row tiles to fill
//     the GPU).
//   kSplit = true: grid (row tiles, 42 chunks); CTA (m, c) computes only
//     chunk c's partial (the same fma chain from +0) and stores it to
//     ws[c][rows][96]; DxFoldChunks then adds the 42 partials in ascending
//     chunk order from +0 per element, exactly the running total above.
//     For small batches, where one CTA per 128 rows leaves SMs idle.
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
    const float* src = valid ? dy + (m0 + r) * kDxK + kt * kDxBK + c4 * 4 : dy;
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

// Thread (tx, ty): rows {ty*4+i, 64+ty*4+i}, columns {tx*2, tx*2+1} +
// {0,32,64}. kSplit: out = ws ([42][rows][96]) and blockIdx.y = chunk; else out
// = dx.
template <bool kSplit>
__global__ void __launch_bounds__(kDxThreads, 1)
    ProjectionInputGradKernel(const float* __restrict__ dy,
                              const float* __restrict__ w,
                              float* __restrict__ out, int64_t rows) {
  extern __shared__ __align__(16) float smem[];
  const int tx = threadIdx.x & 15;
  const int ty = threadIdx.x >> 4;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kDxBM;
  constexpr int kTilesPerChunk = kDxChunk / kDxBK;  // 2
  const int kt_begin =
      kSplit ? static_cast<int>(blockIdx.y) * kTilesPerChunk : 0;
  const int kt_end = kSplit ? kt_begin + kTilesPerChunk : kDxKTiles;
  float total[8][6], part[8][6];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 6; ++j) total[i][j] = part[i][j] = 0.f;
  }
  DxLoadTile(smem + (kt_begin & 1) * kDxStageFloats, dy, w, rows, m0, kt_begin);
  CpAsyncCommit();
  for (int kt = kt_begin; kt < kt_end; ++kt) {
    if (kt + 1 < kt_end) {
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
          const float av = s == 0   ? a[i].x
                           : s == 1 ? a[i].y
                           : s == 2 ? a[i].z
                                    : a[i].w;
#pragma unroll
          for (int j = 0; j < 6; ++j) part[i][j] = fmaf(av, bv[j], part[i][j]);
        }
      }
    }
    if (!kSplit && (kt + 1) % kTilesPerChunk == 0) {  // a chunk is done
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
  // kSplit: the chunk's partial goes to its workspace slot, unrounded by
  // any total (the fold adds it in chunk order).
  float* base =
      kSplit ? out + static_cast<int64_t>(blockIdx.y) * rows * kDxN : out;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = m0 + (i < 4 ? 0 : 64) + ty * 4 + (i & 3);
    if (row >= rows) continue;
    float* o = base + row * kDxN + tx * 2;
#pragma unroll
    for (int g = 0; g < 3; ++g) {
      *reinterpret_cast<float2*>(o + 32 * g) =
          kSplit ? make_float2(part[i][2 * g], part[i][2 * g + 1])
                 : make_float2(total[i][2 * g], total[i][2 * g + 1]);
    }
  }
}

// dx[i] = ((0 + ws[0][i]) + ws[1][i]) + ... + ws[41][i]: the running total
// of kernels/projection_grad.h in ascending chunk order. n = rows * 96 (a
// multiple of 4); one thread per 4 consecutive elements, each its own chain.
__global__ void DxFoldChunks(const float* __restrict__ ws, int64_t n,
                             float* __restrict__ dx) {
  const int64_t i4 =
      (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i4 >= n) return;
  float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 14
  for (int c = 0; c < kDxK / kDxChunk; ++c) {
    const float4 p = *reinterpret_cast<const float4*>(ws + c * n + i4);
    t.x = t.x + p.x;
    t.y = t.y + p.y;
    t.z = t.z + p.z;
    t.w = t.w + p.w;
  }
  *reinterpret_cast<float4*>(dx + i4) = t;
}

// Small batches without a workspace: one CTA of 96 threads per row, thread k
// computes dx[r][k] alone, walking the 42 chunks in order (each chunk a
// sequential fma chain from +0, added to the running total) -- the same
// operations, in the same order, as the CPU. dY[r] is a broadcast across the
// CTA and W's rows are read coalesced; W (2 MB) stays in L2.
inline constexpr int64_t kDxRowSerialMaxRows = 256;

__global__ void __launch_bounds__(kDxN)
    ProjectionInputGradRowSerialKernel(const float* __restrict__ dy,
                                       const float* __restrict__ w,
                                       float* __restrict__ dx) {
  const int64_t r = blockIdx.x;
  const int k = threadIdx.x;
  const float* dyr = dy + r * kDxK;
  const float* wk = w + k;
  float total = 0.f;
  for (int c = 0; c < kDxK / kDxChunk; ++c) {
    const float* dyc = dyr + c * kDxChunk;
    const float* wc = wk + c * kDxChunk * kDxN;
    float partial = 0.f;
#pragma unroll 16
    for (int j = 0; j < kDxChunk; ++j) {
      partial = __fmaf_rn(__ldg(dyc + j), __ldg(wc + j * kDxN), partial);
    }
    total = __fadd_rn(total, partial);
  }
  dx[r * kDxN + k] = total;
}

}  // namespace detlogp::kernels::cuda_detail

#endif  // DETLOGP_KERNELS_CUDA_PROJECTION_INPUT_GRAD_KERNEL_CUH_
