// dW[5376,96] = dY^T . X and dbias = sum_rows dY on the GPU, in the keyed
// three-level order of kernels/projection_grad.h, for a batch whose row i has
// key first_key + i (rows already in key order). Bit-equal to
// ComputeProjectionWeightGrads (CPU) with those keys.
//
// Pass 1 (ProjectionWeightGradKernel<kKParts>): CTA (o-tile, superchunk,
//   k-part) owns 128 outputs o x 96/kKParts columns k (kKParts = 3 for
//   batches of few superchunks, so 126 CTAs fill the GPU; 1 otherwise) and
//   walks its superchunk's rows in key order, in half-chunk tiles of <= 64
//   rows (double-buffered cp.async): a chunk partial is a sequential fma
//   chain per output; at each chunk end it is added to the superchunk total,
//   which lands in workspace slot s. With kKParts = 3, dbias is fused: in
//   k-part 0, the even threads each run the same chunk/superchunk chain
//   (plain adds) for one of the 128 outputs, reading dY from the tile
//   already in shared memory. (Not with kKParts = 1: at the 128-register cap
//   the extra chain spills, so large batches keep pass 1b.)
// Pass 1b (ProjectionBiasGradKernel, kKParts = 1 only): the same order for
//   dbias, one thread per output o and superchunk, coalesced over o.
// Pass 2 (FoldSuperchunks): total = 0; total += slot[s] in ascending s.
// Nothing depends on the grid or the device: only on keys and data.
#ifndef DETLOGP_KERNELS_CUDA_PROJECTION_WEIGHT_GRAD_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_PROJECTION_WEIGHT_GRAD_KERNEL_CUH_

#include <cstdint>

#include "kernels/cuda/projection_cp_async.cuh"

namespace detlogp::kernels::cuda_detail {

inline constexpr int kDwK = 96;    // columns of dW (x features)
inline constexpr int kDwO = 5376;  // rows of dW (outputs)
inline constexpr int kDwBO = 128;  // outputs per CTA
inline constexpr int kDwBR = 64;   // rows per tile: half a key chunk
inline constexpr int kDwThreads = 256;
inline constexpr int64_t kDwChunk = 128;       // == kRowKeyChunk
inline constexpr int64_t kDwSuperKeys = 4096;  // 32 chunks: kRowKeySuperChunk
// Shared memory of one stage for a CTA with kKC = 96 / kKParts columns.
template <int kKParts>
inline constexpr int kDwStageFloatsFor = kDwBR* kDwBO + kDwBR*(kDwK / kKParts);
inline constexpr int kDwStageFloats = kDwStageFloatsFor<1>;
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

// kKC columns of x from k0: bs is [64 rows][kKC].
template <int kKC>
__device__ __forceinline__ void DwLoadTile(float* stage, const float* dy,
                                           const float* x, int o0, int k0,
                                           DwTile t) {
  float* as = stage;                  // [64 rows][128 o]
  float* bs = stage + kDwBR * kDwBO;  // [64 rows][kKC k]
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
  for (int i = 0; i < kDwBR * kKC / 4 / kDwThreads; ++i) {  // 6 or 2
    const int idx = tid + i * kDwThreads;
    const int r = idx / (kKC / 4), c4 = idx % (kKC / 4);
    const bool valid = r < t.count;
    const float* src = valid ? x + (t.begin + r) * kDwK + k0 + c4 * 4 : x;
    CpAsync16(bs + r * kKC + c4 * 4, src, valid);
  }
}

// One row step of the chain: part[i][j] = fma(dy[r][o_i], x[r][k_j], part).
// kG = column groups of 32 per CTA (3, or 1 with kKParts = 3).
template <int kG>
__device__ __forceinline__ void DwRowStep(const float* as, const float* bs,
                                          int r, int tx, int ty,
                                          float (&part)[8][2 * kG]) {
  const float4 a0 = *reinterpret_cast<const float4*>(as + r * kDwBO + ty * 4);
  const float4 a1 =
      *reinterpret_cast<const float4*>(as + r * kDwBO + 64 + ty * 4);
  const float* brow = bs + r * (32 * kG) + tx * 2;
  const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  float bv[2 * kG];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    const float2 b = *reinterpret_cast<const float2*>(brow + 32 * g);
    bv[2 * g] = b.x;
    bv[2 * g + 1] = b.y;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 2 * kG; ++j) {
      part[i][j] = fmaf(av[i], bv[j], part[i][j]);
    }
  }
}

// grid = (42 o-tiles, superchunks touched, kKParts). ws: [superchunks][5376]
// [96]. With one superchunk, `direct` (non-null) gets 0 + total, which is
// what the fold would give, and no workspace is needed. Likewise dbias:
// bias_out (null: no dbias; always null for kKParts = 1) is the final dbias
// when direct, else the slots [superchunks][5376].
template <int kKParts>
__global__ void __launch_bounds__(kDwThreads, 2)
    ProjectionWeightGradKernel(const float* __restrict__ dy,
                               const float* __restrict__ x, int64_t rows,
                               int64_t first_key, float* __restrict__ ws,
                               float* __restrict__ direct,
                               float* __restrict__ bias_out) {
  constexpr int kG = 3 / kKParts;  // column groups of 32
  constexpr int kKC = 32 * kG;     // columns of this CTA
  constexpr int kStageFloats = kDwStageFloatsFor<kKParts>;
  extern __shared__ __align__(16) float smem[];
  const int tx = threadIdx.x & 15;
  const int ty = threadIdx.x >> 4;
  const int o0 = blockIdx.x * kDwBO;
  const int k0 = blockIdx.z * kKC;
  // dbias lanes: k-part 0, even threads, output o0 + ob.
  constexpr bool kFuseBias = kKParts > 1;
  const bool bias_lane = kFuseBias && bias_out != nullptr && blockIdx.z == 0 &&
                         (threadIdx.x & 1) == 0;
  const int ob = threadIdx.x >> 1;
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
  float sup[8][2 * kG], part[8][2 * kG];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 2 * kG; ++j) sup[i][j] = part[i][j] = 0.f;
  }
  float sup_b = 0.f, part_b = 0.f;  // dbias chain (bias lanes)
  if (j_begin < j_end) {
    DwLoadTile<kKC>(smem, dy, x, o0, k0, DwHalf(s, j_begin, first_key, rows));
  }
  CpAsyncCommit();
  for (int j = j_begin; j < j_end; ++j) {
    const int stage = (j - j_begin) & 1;
    if (j + 1 < j_end) {
      DwLoadTile<kKC>(smem + (stage ^ 1) * kStageFloats, dy, x, o0, k0,
                      DwHalf(s, j + 1, first_key, rows));
    }
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    const float* as = smem + stage * kStageFloats;
    const float* bs = as + kDwBR * kDwBO;
    const int count = DwHalf(s, j, first_key, rows).count;
    if (count == kDwBR) {
#pragma unroll 4
      for (int r = 0; r < kDwBR; ++r) DwRowStep<kG>(as, bs, r, tx, ty, part);
    } else {
#pragma unroll 1
      for (int r = 0; r < count; ++r) DwRowStep<kG>(as, bs, r, tx, ty, part);
    }
    if (bias_lane) {  // rows in key order: part_b = part_b + dy[r][o]
#pragma unroll 4
      for (int r = 0; r < count; ++r) part_b = part_b + as[r * kDwBO + ob];
    }
    if ((j & 1) == 1 || j + 1 == j_end) {  // a key chunk ends here
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int k = 0; k < 2 * kG; ++k) {
          sup[i][k] = sup[i][k] + part[i][k];
          part[i][k] = 0.f;
        }
      }
      if (kFuseBias) {
        sup_b = sup_b + part_b;
        part_b = 0.f;
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
    for (int g = 0; g < kG; ++g) {
      *reinterpret_cast<float2*>(out + o * kDwK + k0 + tx * 2 + 32 * g) =
          make_float2(base + sup[i][2 * g], base + sup[i][2 * g + 1]);
    }
  }
  if (bias_lane) {
    if (direct != nullptr) {
      bias_out[o0 + ob] = 0.f + sup_b;  // the fold of one slot
    } else {
      bias_out[static_cast<int64_t>(blockIdx.y) * kDwO + o0 + ob] = sup_b;
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
