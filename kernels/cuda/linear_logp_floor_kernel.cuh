// Speculative top-k floors for the Hopper split kernel (linear_logp_cuda.cu).
//
// A row's splits start with nothing to screen their candidates with, and the
// first waves of a launch, where every row's first splits run together, paid
// about half of top-k's cost inserting values that later fell out of the
// lists (docs/perf.md, "Top-k, session 23"). This kernel runs before the
// split pass and seeds each row's screen word with a guess at a value below
// the row's k-th best: the mean plus `sigmas` standard deviations of z over
// a strided sample of kSampleColumns columns, `sigmas` put where a normal
// distribution would leave ~max(200, 10 k) of the row's V values above it.
//
// A guess can be wrong, and then the row's top-k lists miss values. Such a
// row comes out short: with a floor at or below the k-th best no value of
// the top-k is dropped, while above it fewer than k values of the whole row
// pass, so entry k-1 of the merged list stays empty. The combine marks such
// rows' row blocks (and clears their screens), and the split pass and the
// combine run again over the marked blocks only, with exact screens
// (linear_logp_cuda.cu, Launch). Either way a row's outputs are the k best
// of its values under RanksBefore: the floor, like every screen, changes
// how much work a row costs, never its bits.
//
// The sample's arithmetic is its own (mma.sync, the hidden and weight
// elements paired in a permuted k order): nothing but the guess depends on
// it. It costs ~2 % of logp-only's time at N = 1024 (docs/perf.md, "Top-k,
// session 24", with the designs that were slower).
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/linear_logp_topk.cuh"
#include "kernels/cuda/mma_sync.cuh"
#include "kernels/top_k_screen_key.h"

namespace detlogp::kernels::cuda::floors {

inline constexpr int kSampleColumns = 256;
inline constexpr int kColumnGroups = 8;  // warps of 32 sample columns
inline constexpr int kKParts = 2;        // ... times two halves of k
inline constexpr int kWarps = kColumnGroups * kKParts;
inline constexpr int kThreads = 32 * kWarps;
static_assert(kColumnGroups * 32 == kSampleColumns, "a warp per 32 columns");

struct FloorParams {
  const __nv_bfloat16* hidden;  // [rows][hidden_size]
  // The sample's weight rows and bias, gathered when the weights were
  // bound (vocabulary rows j * (V / kSampleColumns)): read in place, the
  // strided rows of the full matrix took ~2x as long.
  const __nv_bfloat16* sample_weight;  // [kSampleColumns][hidden_size]
  const float* sample_bias;            // [kSampleColumns] or null
  const float* temperatures;    // [rows], or null: temperature
  float temperature;
  int64_t hidden_size;          // a multiple of 64
  int32_t rows;
  float sigmas;
  uint32_t* top_screen;         // [rows][epilogue::kScreenWords] out
  int32_t* rerun_blocks;        // [row_blocks + 1], zeroed here
  int32_t row_blocks;
  int32_t block_rows;           // rows per row block of the split kernel
};

// One 32-k block of a thread's operands: for each m16 tile its rows g and
// g + 8, and its four n8 tiles' column g, 8 consecutive k each.
template <int kMTiles>
struct Fragments {
  uint4 a[kMTiles], b[kMTiles], w[4];
};

template <int kMTiles>
__device__ __forceinline__ Fragments<kMTiles> LoadFragments(
    const uint4* const* ha, const uint4* const* hb, const uint4* const* wc,
    int kb) {
  Fragments<kMTiles> f;
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
    f.a[m] = __ldg(ha[m] + 4 * kb);
    f.b[m] = __ldg(hb[m] + 4 * kb);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) f.w[j] = __ldg(wc[j] + 4 * kb);
  return f;
}

// Each thread's 8 consecutive k go to two m16n8k16 steps as the k the
// fragment layout gives it: products pair the same k of hidden and weight,
// so the sums are dot products in another order.
template <int kMTiles>
__device__ __forceinline__ void MultiplyFragments(const Fragments<kMTiles>& f,
                                                  float (*acc)[4][4]) {
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t low[4] = {f.a[m].x, f.b[m].x, f.a[m].y, f.b[m].y};
      const uint32_t high[4] = {f.a[m].z, f.b[m].z, f.a[m].w, f.b[m].w};
      MmaM16N8K16(acc[m][j], low, f.w[j].x, f.w[j].y);
      MmaM16N8K16(acc[m][j], high, f.w[j].z, f.w[j].w);
    }
  }
}

// Calls f(value, slot, column) for each of a thread's accumulators: slot
// 2 m + e / 2 is its row's (16 m + g, or + 8 when odd), column its sample
// column 32 group + 8 j + 2 t + e % 2.
template <int kMTiles, typename F>
__device__ __forceinline__ void ForEachValue(float (*acc)[4][4], int group,
                                             int t, F f) {
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        f(acc[m][j][e], 2 * m + e / 2, 32 * group + 8 * j + 2 * t + (e & 1));
      }
    }
  }
}

// Sums over the block's warps of per-thread values for block rows
// 16 (i / 2) + 8 (i % 2) + g (v[i], i < 2 kMTiles), each first summed over
// the row's quad; lands in out[r], visible after the closing barrier.
template <int kMTiles>
__device__ __forceinline__ void BlockRowSums(const float* v, float (*part)[32],
                                             float* out) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < 2 * kMTiles; ++i) {
    float x = v[i];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    // v[i] is row 16 (i / 2) + 8 (i % 2) + g.
    if ((lane & 3) == 0) part[warp][16 * (i / 2) + 8 * (i % 2) + (lane >> 2)] = x;
  }
  __syncthreads();
  if (threadIdx.x < 16 * kMTiles) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += part[w][threadIdx.x];
    out[threadIdx.x] = s;
  }
  __syncthreads();
}

// One block per 16 kMTiles rows: z of the rows' kSampleColumns sample
// columns (warp w: columns [32 (w % 8), + 32), k half w / 8), their mean
// and deviation, and the rows' screens written whole: the floor's key in
// the word, zeros elsewhere (what the split kernel expects of a cleared
// screen).
template <int kMTiles>
__global__ void __launch_bounds__(kThreads)
    TopKFloorKernel(const __grid_constant__ FloorParams p) {
  constexpr int kRows = 16 * kMTiles;
  __shared__ float part[kWarps][32];
  __shared__ float sums[32];
  __shared__ uint32_t keys[32];
  __shared__ float half_acc[kColumnGroups][kMTiles * 16][32];  // k half 1's
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int group = warp % kColumnGroups;
  const int k_part = warp / kColumnGroups;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int row0 = blockIdx.x * kRows;
  // Rows past the batch read its last row; nothing of theirs is written.
  int ra[kMTiles], rb[kMTiles];
  const uint4* ha[kMTiles];
  const uint4* hb[kMTiles];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
    ra[m] = min(row0 + 16 * m + g, p.rows - 1);
    rb[m] = min(row0 + 16 * m + g + 8, p.rows - 1);
    ha[m] = reinterpret_cast<const uint4*>(p.hidden + ra[m] * p.hidden_size) + t;
    hb[m] = reinterpret_cast<const uint4*>(p.hidden + rb[m] * p.hidden_size) + t;
  }
  const uint4* wc[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t v = 32 * group + 8 * j + g;
    wc[j] = reinterpret_cast<const uint4*>(p.sample_weight + v * p.hidden_size) + t;
  }
  float acc[kMTiles][4][4] = {};
  const int k_blocks = static_cast<int>(p.hidden_size / 32) / kKParts;
  const int kb0 = k_part * k_blocks;
  // Two blocks of operands in flight: the next one loads while this one
  // multiplies.
  Fragments<kMTiles> cur = LoadFragments<kMTiles>(ha, hb, wc, kb0);
  for (int kb = kb0; kb < kb0 + k_blocks; ++kb) {
    Fragments<kMTiles> next = cur;
    if (kb + 1 < kb0 + k_blocks) next = LoadFragments<kMTiles>(ha, hb, wc, kb + 1);
    MultiplyFragments<kMTiles>(cur, acc);
    cur = next;
  }
  // The second k half hands its sums to the first.
  if (k_part == 1) {
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
      for (int i = 0; i < 16; ++i) half_acc[group][16 * m + i][lane] = acc[m][i / 4][i % 4];
    }
  }
  __syncthreads();
  if (k_part == 0) {
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[m][i / 4][i % 4] += half_acc[group][16 * m + i][lane];
    }
  }

  // acc[m][j][e] is row 16 m + g (e < 2) or + 8, column
  // 32 group + 8 j + 2 t + e % 2; it becomes z in place. Warps of the
  // second half add zeros.
  float sum[2 * kMTiles] = {};
  float inv_t[2 * kMTiles];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
    inv_t[2 * m] = 1.0f / (p.temperatures != nullptr ? p.temperatures[ra[m]] : p.temperature);
    inv_t[2 * m + 1] = 1.0f / (p.temperatures != nullptr ? p.temperatures[rb[m]] : p.temperature);
  }
  ForEachValue<kMTiles>(acc, group, t, [&](float& z, int slot, int column) {
    const float bias = p.sample_bias != nullptr ? p.sample_bias[column] : 0.0f;
    z = (z + bias) * inv_t[slot];
    if (k_part == 0) sum[slot] += z;
  });
  BlockRowSums<kMTiles>(sum, part, sums);
  float mean[2 * kMTiles], sq[2 * kMTiles] = {};
#pragma unroll
  for (int i = 0; i < 2 * kMTiles; ++i) {
    mean[i] = sums[16 * (i / 2) + 8 * (i % 2) + g] / kSampleColumns;
  }
  __syncthreads();  // sums is reused
  ForEachValue<kMTiles>(acc, group, t, [&](float& z, int slot, int) {
    const float d = z - mean[slot];
    if (k_part == 0) sq[slot] += d * d;
  });
  BlockRowSums<kMTiles>(sq, part, sums);
  if (warp == 0 && t == 0) {
#pragma unroll
    for (int i = 0; i < 2 * kMTiles; ++i) {
      const int r = 16 * (i / 2) + 8 * (i % 2) + g;
      const float floor = mean[i] + p.sigmas * sqrtf(sums[r] / (kSampleColumns - 1));
      keys[r] = isfinite(floor) ? ScreenKey(floor) : 0u;
    }
  }
  __syncthreads();

  constexpr int kWords = epilogue::kScreenWords;
  for (int i = threadIdx.x; i < kRows * kWords; i += kThreads) {
    const int r = i / kWords;
    const int word = i - r * kWords;
    if (row0 + r < p.rows) {
      p.top_screen[static_cast<int64_t>(row0 + r) * kWords + word] =
          word == epilogue::kScreenWord ? keys[r] : 0u;
    }
  }
  if (threadIdx.x == 0) {
    if (row0 % p.block_rows == 0) p.rerun_blocks[row0 / p.block_rows] = 0;
    if (blockIdx.x == 0) p.rerun_blocks[p.row_blocks] = 0;  // the count
  }
}

// Blocks of 16 rows (kMTiles = 1), the form measured on the H200.
// kMTiles = 2 (32 rows sharing each weight fragment; 28 bytes of spills)
// has never run there: measure it before launching it for large N.
static inline cudaError_t EnqueueFloorKernel(const FloorParams& p,
                                             cudaStream_t stream) {
  TopKFloorKernel<1><<<static_cast<unsigned>((p.rows + 15) / 16), kThreads, 0,
                       stream>>>(p);
  return cudaGetLastError();
}

}  // namespace detlogp::kernels::cuda::floors

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_
