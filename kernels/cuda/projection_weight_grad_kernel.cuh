// dW[5376,96] = dY^T . X and dbias = sum_rows dY on the GPU, in the keyed
// three-level order of kernels/projection_grad.h, for a batch whose row i has
// key first_key + i (rows already in key order). Bit-equal to
// ComputeProjectionWeightGrads (CPU) with those keys.
//
// Pass 1 (ProjectionWeightGradKernel): CTA (o-tile, superchunk) owns 128
//   outputs o x all 96 k and walks its superchunk's rows in key order, in
//   half-chunk tiles of <= 64 rows (double-buffered cp.async): a chunk partial
//   is a sequential fma chain per output; at each chunk end it is added to the
//   superchunk total, which lands in workspace slot s.
// Pass 1b (ProjectionBiasGradKernel): the same order for dbias, one thread per
//   output o and superchunk, coalesced over o.
// Pass 2 (FoldSuperchunks): total = 0; total += slot[s] in ascending s.
// Nothing depends on the grid or the device: only on keys and data.
#ifndef DETLOGP_KERNELS_CUDA_PROJECTION_WEIGHT_GRAD_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_PROJECTION_WEIGHT_GRAD_KERNEL_CUH_

#include <cstdint>

#include "kernels/cuda/projection_cp_async.cuh"

namespace detlogp::kernels::cuda_detail {

inline constexpr int kDwK = 96;     // columns of dW (x features)
inline constexpr int kDwO = 5376;   // rows of dW (outputs)
inline constexpr int kDwBO = 128;   // outputs per CTA
inline constexpr int kDwBR = 64;    // rows per tile: half a key chunk
inline constexpr int kDwThreads = 256;
inline constexpr int64_t kDwChunk = 128;        // == kRowKeyChunk
inline constexpr int64_t kDwSuperKeys = 4096;   // 32 chunks: kRowKeySuperChunk
inline constexpr int kDwStageFloats = kDwBR * kDwBO + kDwBR * kDwK;
inline constexpr int kDwStageBytes = kDwStageFloats * 4;  // 57,344

// The rows [begin, begin + count) of half-chunk tile `j` of a superchunk.
struct DwTile {
  int64_t begin;
  int count;
};

// Half-chunk j of superchunk s, clipped to the batch's keys.
__device__ __forceinline__ DwTile DwHalf(int64_t s, int j, int64_t first_key,
                                         int64_t rows) {
  const int64_t key_lo = s * kDwSuperKeys + int64_t{j} * kDwBR;
  int64_t lo = key_lo - first_key, hi = lo + kDwBR;
  lo = lo < 0 ? 0 : lo;
  hi = hi > rows ? rows : hi;
  return {lo, hi > lo ? static_cast<int>(hi - lo) : 0};
}

__device__ __forceinline__ void DwLoadTile(float* stage, const float* dy,
                                           const float* x, int o0,
                                           DwTile t) {
  float* as = stage;                  // [64 rows][128 o]
  float* bs = stage + kDwBR * kDwBO;  // [64 rows][96 k]
  const int tid = threadIdx.x;
#pragma unroll 1
  for (int i = 0; i < kDwBR * kDwBO / 4 / kDwThreads; ++i) {  // 8
    const int idx = tid + i * kDwThreads;
    const int r = idx / (kDwBO / 4), c4 = idx % (kDwBO / 4);
    const bool valid = r < t.count;
    const float* src = valid ? dy + (t.begin + r) * kDwO + o0 + c4 * 4 : dy;
    CpAsync16(as + r * kDwBO + c4 * 4, src, valid);
  }
#pragma unroll 1
  for (int i = 0; i < kDwBR * kDwK / 4 / kDwThreads; ++i) {  // 6
    const int idx = tid + i * kDwThreads;
    const int r = idx / (kDwK / 4), c4 = idx % (kDwK / 4);
    const bool valid = r < t.count;
    const float* src = valid ? x + (t.begin + r) * kDwK + c4 * 4 : x;
    CpAsync16(bs + r * kDwK + c4 * 4, src, valid);
  }
}

// One row step of the chain: part[i][j] = fma(dy[r][o_i], x[r][k_j], part).
__device__ __forceinline__ void DwRowStep(const float* as, const float* bs,
                                          int r, int tx, int ty,
                                          float (&part)[8][6]) {
  const float4 a0 = *reinterpret_cast<const float4*>(as + r * kDwBO + ty * 4);
  const float4 a1 =
      *reinterpret_cast<const float4*>(as + r * kDwBO + 64 + ty * 4);
  const float* brow = bs + r * kDwK + tx * 2;
  const float2 b0 = *reinterpret_cast<const float2*>(brow);
  const float2 b1 = *reinterpret_cast<const float2*>(brow + 32);
  const float2 b2 = *reinterpret_cast<const float2*>(brow + 64);
  const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  const float bv[6] = {b0.x, b0.y, b1.x, b1.y, b2.x, b2.y};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 6; ++j) part[i][j] = fmaf(av[i], bv[j], part[i][j]);
  }
}

// grid = (42 o-tiles, superchunks touched). ws: [superchunks][5376][96].
// With one superchunk, `direct` (non-null) gets 0 + total, which is what the
// fold would give, and no workspace is needed.
__global__ void __launch_bounds__(kDwThreads, 2)
    ProjectionWeightGradKernel(const float* __restrict__ dy,
                               const float* __restrict__ x, int64_t rows,
                               int64_t first_key, float* __restrict__ ws,
                               float* __restrict__ direct) {
  extern __shared__ __align__(16) float smem[];
  const int tx = threadIdx.x & 15;
  const int ty = threadIdx.x >> 4;
  const int o0 = blockIdx.x * kDwBO;
  const int64_t s = first_key / kDwSuperKeys + blockIdx.y;
  constexpr int kHalves = static_cast<int>(kDwSuperKeys / kDwBR);  // 64
  // Only the first and last halves can be empty: find the non-empty range.
  int j_begin = 0, j_end = kHalves;
  while (j_begin < kHalves && DwHalf(s, j_begin, first_key, rows).count == 0) {
    ++j_begin;
  }
  while (j_end > j_begin && DwHalf(s, j_end - 1, first_key, rows).count == 0) {
    --j_end;
  }
  float sup[8][6], part[8][6];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 6; ++j) sup[i][j] = part[i][j] = 0.f;
  }
  if (j_begin < j_end) {
    DwLoadTile(smem, dy, x, o0, DwHalf(s, j_begin, first_key, rows));
  }
  CpAsyncCommit();
  for (int j = j_begin; j < j_end; ++j) {
    const int stage = (j - j_begin) & 1;
    if (j + 1 < j_end) {
      DwLoadTile(smem + (stage ^ 1) * kDwStageFloats, dy, x, o0,
                 DwHalf(s, j + 1, first_key, rows));
    }
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    const float* as = smem + stage * kDwStageFloats;
    const float* bs = as + kDwBR * kDwBO;
    const int count = DwHalf(s, j, first_key, rows).count;
    if (count == kDwBR) {
#pragma unroll 4
      for (int r = 0; r < kDwBR; ++r) DwRowStep(as, bs, r, tx, ty, part);
    } else {
#pragma unroll 1
      for (int r = 0; r < count; ++r) DwRowStep(as, bs, r, tx, ty, part);
    }
    if ((j & 1) == 1 || j + 1 == j_end) {  // a key chunk ends here
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int k = 0; k < 6; ++k) {
          sup[i][k] = sup[i][k] + part[i][k];
          part[i][k] = 0.f;
        }
      }
    }
    __syncthreads();  // this stage is refilled two tiles on
  }
  float* out = direct != nullptr
                   ? direct
                   : ws + static_cast<int64_t>(blockIdx.y) * kDwO * kDwK;
  const float base = direct != nullptr ? 0.f : -0.f;  // -0 + v == v exactly
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int o = o0 + (i < 4 ? 0 : 64) + ty * 4 + (i & 3);
#pragma unroll
    for (int g = 0; g < 3; ++g) {
      *reinterpret_cast<float2*>(out + o * kDwK + tx * 2 + 32 * g) =
          make_float2(base + sup[i][2 * g], base + sup[i][2 * g + 1]);
    }
  }
}

// grid = (ceil(5376/256), superchunks touched). ws_b: [superchunks][5376];
// `direct` as in ProjectionWeightGradKernel.
__global__ void ProjectionBiasGradKernel(const float* __restrict__ dy,
                                         int64_t rows, int64_t first_key,
                                         float* __restrict__ ws_b,
                                         float* __restrict__ direct) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= kDwO) return;
  const int64_t s = first_key / kDwSuperKeys + blockIdx.y;
  const int64_t key_lo = s * kDwSuperKeys;
  float sup = 0.f;
  for (int64_t c = 0; c < kDwSuperKeys / kDwChunk; ++c) {
    int64_t lo = key_lo + c * kDwChunk - first_key, hi = lo + kDwChunk;
    lo = lo < 0 ? 0 : lo;
    hi = hi > rows ? rows : hi;
    if (hi <= lo) continue;  // empty chunk: no term
    float part = 0.f;
#pragma unroll 8
    for (int64_t r = lo; r < hi; ++r) part = part + dy[r * kDwO + o];
    sup = sup + part;
  }
  if (direct != nullptr) {
    direct[o] = 0.f + sup;  // the fold of one slot
  } else {
    ws_b[static_cast<int64_t>(blockIdx.y) * kDwO + o] = sup;
  }
}

// out[i] = ((0 + ws[0][i]) + ws[1][i]) + ... over `slots` slots of `n`.
__global__ void FoldSuperchunks(const float* __restrict__ ws, int64_t slots,
                                int64_t n, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float total = 0.f;
  for (int64_t s = 0; s < slots; ++s) total = total + ws[s * n + i];
  out[i] = total;
}

}  // namespace detlogp::kernels::cuda_detail

#endif  // DETLOGP_KERNELS_CUDA_PROJECTION_WEIGHT_GRAD_KERNEL_CUH_
