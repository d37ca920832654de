// Speculative top-k floors for the Hopper split kernel (linear_logp_cuda.cu).
//
// A row's splits start with nothing to screen their candidates with, and the
// first waves of a launch, where every row's first splits run together, paid
// about half of top-k's cost inserting values that later fell out of the
// lists (docs/kernels.md, "Top-k floors"). This kernel runs before the
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
// it. Each 16-row tile reads the whole sample (2 MiB at H = 4096), and what
// bounds a block is the loads its warps keep in flight: the sample is
// stored in the order the warps read it (every load 512 contiguous bytes),
// a block has 16 warps, and when the batch has few row tiles a cluster of
// blocks splits the hidden dimension and adds its partial sums through
// distributed shared memory (docs/performance.md lists the designs that
// were slower).
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/linear_logp_topk.cuh"
#include "kernels/cuda/mma_sync.cuh"
#include "kernels/top_k_screen_key.h"

namespace detlogp::kernels::cuda::floors {

inline constexpr int kSampleColumns = 256;
inline constexpr int kTileRows = 16;  // one m16 tile of rows per cluster
inline constexpr int kBlockK = 32;    // k per step: two m16n8k16 each
inline constexpr int kSampleTiles = kSampleColumns / 8;  // n8 tiles
inline constexpr int kColumnGroups = 4;                  // warps of 8 n8 tiles
inline constexpr int kGroupTiles = kSampleTiles / kColumnGroups;
// ... times four parts of k. The warps' loads in flight bound the kernel:
// 8 warps an SM brought ~50 GB/s, 16 ~85 on the H200; 16 warps leave 128
// registers a thread.
inline constexpr int kKParts = 4;
inline constexpr int kWarps = kColumnGroups * kKParts;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kMaxKSplits = 4;  // blocks in a cluster
static_assert(kTileRows % kMaxKSplits == 0, "ranks share the tile's rows");

// Where the sample keeps uint4 `lane` of n8 tile `tile` for k step `kb`:
// sample column 8 tile + lane / 4's weights for k = 32 kb + 8 (lane % 4)
// + [0, 8), the 8 k a thread pairs with its hidden rows' in the kernel. A
// warp's kGroupTiles tiles of one step are 4 KiB in a row.
__host__ __device__ inline int64_t SampleIndex(int64_t kb, int tile, int lane) {
  return (kb * kSampleTiles + tile) * 32 + lane;
}

// Gathers the sample (vocabulary rows j * stride, j < kSampleColumns) into
// SampleIndex order, one thread per uint4, and their bias into bias_out.
__global__ void GatherSampleKernel(const __nv_bfloat16* weight,
                                   const float* bias, int64_t hidden_size,
                                   int64_t stride, uint4* sample,
                                   float* bias_out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bias != nullptr && i < kSampleColumns) bias_out[i] = bias[i * stride];
  if (i >= hidden_size / 8 * kSampleColumns) return;
  const int lane = static_cast<int>(i % 32);
  const int tile = static_cast<int>(i / 32 % kSampleTiles);
  const int64_t kb = i / 32 / kSampleTiles;
  const int64_t column = 8 * tile + lane / 4;
  const int64_t k = kBlockK * kb + 8 * (lane % 4);
  sample[i] = *reinterpret_cast<const uint4*>(
      weight + column * stride * hidden_size + k);
}

struct FloorParams {
  const __nv_bfloat16* hidden;  // [rows][hidden_size]
  const uint4* sample;          // GatherSampleKernel's
  const float* sample_bias;     // [kSampleColumns] or null
  const float* temperatures;    // [rows], or null: temperature
  float temperature;
  int64_t hidden_size;  // a multiple of 64
  int32_t rows;
  int32_t k_splits;  // 1, 2 or 4: the cluster's size
  float sigmas;
  uint32_t* top_screen;   // [rows][epilogue::kScreenWords] out
  int32_t* rerun_blocks;  // [row_blocks + 1], zeroed here
  int32_t row_blocks;
  int32_t block_rows;  // rows per row block of the split kernel
};

// A thread's operands of one k step: its rows g and g + 8, and its group's
// n8 tiles' column g, 8 consecutive k each.
struct Operands {
  uint4 a, b, w[kGroupTiles];
};

__device__ __forceinline__ Operands LoadOperands(const uint4* ha,
                                                 const uint4* hb,
                                                 const uint4* w, int kb) {
  Operands o;
  o.a = __ldg(ha + 4 * kb);
  o.b = __ldg(hb + 4 * kb);
#pragma unroll
  for (int j = 0; j < kGroupTiles; ++j) {
    o.w[j] = __ldg(w + SampleIndex(kb, j, 0));
  }
  return o;
}

// Each thread's 8 consecutive k go to two m16n8k16 steps as the k the
// fragment layout gives it: products pair the same k of hidden and weight,
// so the sums are dot products in another order.
__device__ __forceinline__ void Multiply(const Operands& o, float (*acc)[4]) {
  const uint32_t low[4] = {o.a.x, o.b.x, o.a.y, o.b.y};
  const uint32_t high[4] = {o.a.z, o.b.z, o.a.w, o.b.w};
#pragma unroll
  for (int j = 0; j < kGroupTiles; ++j) {
    MmaM16N8K16(acc[j], low, o.w[j].x, o.w[j].y);
    MmaM16N8K16(acc[j], high, o.w[j].z, o.w[j].w);
  }
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// One cluster of k_splits blocks per kTileRows rows. Block rank q's warp
// (group c, part h) sums the products of sample columns [64 c, + 64) over
// its share (4 q + h of 4 k_splits) of the k steps; the parts' sums meet in
// the block's shared memory, the ranks' through the cluster's, added in
// rank order. Rank q then finishes rows [q, q + 1) * kTileRows / k_splits:
// z, their mean and deviation, and the rows' screens written whole (the
// floor's key in the word, zeros elsewhere: what the split kernel expects
// of a cleared screen).
__global__ void __launch_bounds__(kThreads, 1)
    TopKFloorKernel(const __grid_constant__ FloorParams p) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  // Padded so that the quads' writes of one accumulator spread over banks.
  __shared__ float partial[kTileRows][kSampleColumns + 8];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int group = warp % kColumnGroups;
  const int k_part = warp / kColumnGroups;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int rank = static_cast<int>(cluster.block_rank());
  const int row0 = static_cast<int>(blockIdx.x) / p.k_splits * kTileRows;

  // Rows past the batch read its last row; nothing of theirs is written.
  const int ra = min(row0 + g, p.rows - 1);
  const int rb = min(row0 + g + 8, p.rows - 1);
  const uint4* ha =
      reinterpret_cast<const uint4*>(p.hidden + ra * p.hidden_size) + t;
  const uint4* hb =
      reinterpret_cast<const uint4*>(p.hidden + rb * p.hidden_size) + t;
  const uint4* w = p.sample + SampleIndex(0, kGroupTiles * group, lane);
  const int k_steps = static_cast<int>(p.hidden_size / kBlockK);
  const int part = rank * kKParts + k_part;
  const int parts = p.k_splits * kKParts;
  const int kb_begin = k_steps * part / parts;
  const int kb_end = k_steps * (part + 1) / parts;

  float acc[kGroupTiles][4] = {};
  // Two steps of operands in flight: the next one loads while this one
  // multiplies.
  Operands cur = LoadOperands(ha, hb, w, kb_begin);
  for (int kb = kb_begin; kb < kb_end; ++kb) {
    Operands next = cur;
    if (kb + 1 < kb_end) next = LoadOperands(ha, hb, w, kb + 1);
    Multiply(cur, acc);
    cur = next;
  }

  // acc[j][e] is row g + 8 (e / 2), column 64 group + 8 j + 2 t + e % 2.
  auto at = [&](int j, int e) -> float& {
    return partial[g + 8 * (e / 2)]
                  [kGroupTiles * 8 * group + 8 * j + 2 * t + (e & 1)];
  };
  // The parts' sums in a fixed order, the last part's first.
  for (int q = kKParts - 1; q >= 0; --q) {
    if (k_part == q) {
#pragma unroll
      for (int j = 0; j < kGroupTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          at(j, e) = q == kKParts - 1 ? acc[j][e] : acc[j][e] + at(j, e);
        }
      }
    }
    if (q > 0) __syncthreads();
  }
  cluster.sync();  // every rank's partial sums are in place

  const float* ranks[kMaxKSplits];  // unrolled: kept in registers
#pragma unroll
  for (int q = 0; q < kMaxKSplits; ++q) {
    ranks[q] = cluster.map_shared_rank(&partial[0][0], min(q, p.k_splits - 1));
  }
  constexpr int kPerLane = kSampleColumns / 32;
  const int rank_rows = kTileRows / p.k_splits;
  for (int r = rank * rank_rows + warp; r < (rank + 1) * rank_rows;
       r += kWarps) {
    const int row = min(row0 + r, p.rows - 1);
    const float inv_t = 1.0f / (p.temperatures != nullptr ? p.temperatures[row]
                                                          : p.temperature);
    float z[kPerLane];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int column = lane + 32 * i;
      const int offset = r * (kSampleColumns + 8) + column;
      float x = ranks[0][offset];
#pragma unroll
      for (int q = 1; q < kMaxKSplits; ++q) {
        if (q < p.k_splits) x += ranks[q][offset];
      }
      const float bias =
          p.sample_bias != nullptr ? p.sample_bias[column] : 0.0f;
      z[i] = (x + bias) * inv_t;
      sum += z[i];
    }
    const float mean = WarpSum(sum) / kSampleColumns;
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) sq += (z[i] - mean) * (z[i] - mean);
    const float floor =
        mean + p.sigmas * sqrtf(WarpSum(sq) / (kSampleColumns - 1));
    const uint32_t key = isfinite(floor) ? ScreenKey(floor) : 0u;
    if (row0 + r < p.rows) {
      constexpr int kWords = epilogue::kScreenWords;
      uint32_t* screen = p.top_screen + static_cast<int64_t>(row0 + r) * kWords;
      for (int word = lane; word < kWords; word += 32) {
        screen[word] = word == epilogue::kScreenWord ? key : 0u;
      }
    }
  }
  if (rank == 0 && threadIdx.x == 0) {
    if (row0 % p.block_rows == 0) p.rerun_blocks[row0 / p.block_rows] = 0;
    if (blockIdx.x == 0) p.rerun_blocks[p.row_blocks] = 0;  // the count
  }
  cluster.sync();  // no rank leaves while another reads its partial sums
}

// Blocks per cluster: enough to fill the SMs when the batch has few row
// tiles (each block then reads 1 / k_splits of the sample).
inline int FloorKSplits(int64_t rows, int num_sms) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  for (int s = kMaxKSplits; s > 1; s /= 2) {
    if (tiles * s <= num_sms) return s;
  }
  return 1;
}

static inline cudaError_t EnqueueFloorKernel(const FloorParams& p,
                                             cudaStream_t stream) {
  if (p.k_splits < 1 || p.k_splits > kMaxKSplits ||
      kMaxKSplits % p.k_splits != 0) {
    return cudaErrorInvalidValue;
  }
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(p.k_splits);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(
      static_cast<unsigned>((p.rows + kTileRows - 1) / kTileRows * p.k_splits));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, TopKFloorKernel, p);
}

static inline cudaError_t EnqueueGatherSample(
    const __nv_bfloat16* weight, const float* bias, int64_t hidden_size,
    int64_t vocab_size, uint4* sample, float* bias_out, cudaStream_t stream) {
  const int64_t count = hidden_size / 8 * kSampleColumns;
  constexpr int kBlock = 256;
  GatherSampleKernel<<<static_cast<unsigned>((count + kBlock - 1) / kBlock),
                       kBlock, 0, stream>>>(
      weight, bias, hidden_size, vocab_size / kSampleColumns, sample, bias_out);
  return cudaGetLastError();
}

}  // namespace detlogp::kernels::cuda::floors

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_
