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
// it. It costs ~1 % of logp-only's time (docs/perf.md, "Top-k, session 24").
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/linear_logp_topk.cuh"
#include "kernels/cuda/projection_cp_async.cuh"
#include "kernels/top_k_screen_key.h"

namespace detlogp::kernels::cuda::floors {

inline constexpr int kSampleColumns = 256;
inline constexpr int kWarps = 8;  // each on 32 sample columns
inline constexpr int kThreads = 32 * kWarps;
static_assert(kWarps * 32 == kSampleColumns, "a warp per 32 columns");
// The k loop: chunks of 64 k (128 bytes of a row) through a kStages-deep
// cp.async ring in shared memory.
inline constexpr int kChunkK = 64;
inline constexpr int kStages = 4;

struct FloorParams {
  const __nv_bfloat16* hidden;  // [rows][hidden_size]
  // The sample's weight rows and bias, gathered when the weights were
  // bound (vocabulary rows j * (V / kSampleColumns)), chunk by chunk:
  // [hidden_size / kChunkK][kSampleColumns][kChunkK], so that the chunk
  // every block reads at once is one contiguous run. Read in place, the
  // strided rows of the full matrix cost TLB misses, and rows 8 KiB apart
  // crowded a few L2 slices (~40-120 us at N = 1024).
  const __nv_bfloat16* sample_weight;
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

// Shared memory of a block of 16 kMTiles rows: each stage holds the chunk
// of every sample column, then of the block's rows.
template <int kMTiles>
inline constexpr int kSmemBytes =
    kStages * (kSampleColumns + 16 * kMTiles) * kChunkK * 2;

__device__ __forceinline__ void MmaBf16(float* d, uint32_t a0, uint32_t a1,
                                        uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where 16-byte piece `piece` (k 8 piece ..) of staged row `row` lies, in
// pieces from the stage's start: rows of 8 pieces, pieces permuted by the
// row so that the fragment reads (8 lanes: rows g, g + 1 of a pair, pieces
// 4 s + t) hit 8 different bank groups.
__device__ __forceinline__ int StagedPiece(int row, int piece) {
  return row * 8 + (piece ^ ((row & 1) << 2) ^ ((row >> 1) & 3));
}

__device__ __forceinline__ uint4 LoadStaged(const uint4* stage, int row,
                                            int piece) {
  return stage[StagedPiece(row, piece)];
}

// Asks L2 for bytes [begin, end) of `base` in 4 KiB pieces, spread over the
// block's threads (sm_90 bulk prefetch; 16-byte aligned ends).
__device__ __forceinline__ void PrefetchToL2(const void* base, int64_t begin,
                                             int64_t end) {
  constexpr int64_t kPiece = 4096;
  for (int64_t at = begin + threadIdx.x * kPiece; at < end;
       at += int64_t{kThreads} * kPiece) {
    const int64_t size = end - at < kPiece ? end - at : kPiece;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                     static_cast<const char*>(base) + at),
                 "r"(static_cast<uint32_t>(size))
                 : "memory");
  }
}

// Sums over the block's warps of per-thread values for block rows
// 16 (i / 2) + 8 (i % 2) + g (i < 2 kMTiles), each first summed over the
// row's quad; lands in out[r], visible after the closing barrier.
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
// columns (warp w: columns [32 w, 32 w + 32)), their mean and deviation,
// and the rows' screens written whole: the floor's key in the word, zeros
// elsewhere (what the split kernel expects of a cleared screen).
template <int kMTiles>
__global__ void __launch_bounds__(kThreads)
    TopKFloorKernel(const __grid_constant__ FloorParams p) {
  constexpr int kRows = 16 * kMTiles;
  constexpr int kStagePieces = (kSampleColumns + kRows) * 8;
  extern __shared__ uint4 staged[];  // [kStages][kStagePieces]
  __shared__ float part[kWarps][32];
  __shared__ float sums[32];
  __shared__ uint32_t keys[32];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int row0 = blockIdx.x * kRows;
  const int chunks = static_cast<int>(p.hidden_size / kChunkK);

  // The split pass before this launch has streamed the whole weight matrix
  // through L2, so the sample comes from HBM, and every block walks it
  // chunk by chunk in step: asked for a few chunks at a time, it took ~70
  // us at N = 1024 (HBM latency-bound). Each block first asks for its share
  // of the sample and for its own rows, so that the loop below hits L2.
  {
    const int64_t sample_bytes = int64_t{kSampleColumns} * p.hidden_size * 2;
    const int64_t share = (sample_bytes / gridDim.x + 15) / 16 * 16;
    const int64_t begin = min(sample_bytes, share * blockIdx.x);
    PrefetchToL2(p.sample_weight, begin, min(sample_bytes, begin + share));
    const int64_t row_bytes = p.hidden_size * 2;
    PrefetchToL2(p.hidden, row0 * row_bytes,
                 min(p.rows, row0 + kRows) * row_bytes);
  }
  // Chunk c into stage c % kStages: sample rows, then the block's rows
  // (rows past the batch copy its last row; nothing of theirs is written).
  auto issue = [&](int c) {
    uint4* stage = staged + (c % kStages) * kStagePieces;
    for (int i = threadIdx.x; i < (kSampleColumns + kRows) * 8; i += kThreads) {
      const int row = i / 8;
      const int piece = i % 8;
      const __nv_bfloat16* src =
          row < kSampleColumns
              ? p.sample_weight + (static_cast<int64_t>(c) * kSampleColumns + row) * kChunkK
              : p.hidden + min(row0 + row - kSampleColumns, p.rows - 1) * p.hidden_size +
                    c * kChunkK;
      cuda_detail::CpAsync16(reinterpret_cast<float*>(stage + StagedPiece(row, piece)),
                             reinterpret_cast<const float*>(src + piece * 8), true);
    }
  };
  for (int c = 0; c < kStages - 1; ++c) {
    if (c < chunks) issue(c);
    cuda_detail::CpAsyncCommit();
  }
  float acc[kMTiles][4][4] = {};
  for (int c = 0; c < chunks; ++c) {
    cuda_detail::CpAsyncWait<kStages - 2>();
    __syncthreads();  // chunk c is in; every warp is done with chunk c - 1
    if (c + kStages - 1 < chunks) issue(c + kStages - 1);
    cuda_detail::CpAsyncCommit();
    const uint4* stage = staged + (c % kStages) * kStagePieces;
    // Thread t's pieces 4 s + t (k 8 (4 s + t) ..) go to two m16n8k16 steps
    // as the k the fragment layout gives it: products pair the same k of
    // hidden and weight, so the sums are dot products in another order.
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint4 w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = LoadStaged(stage, 32 * warp + 8 * j + g, 4 * s + t);
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        const uint4 a = LoadStaged(stage, kSampleColumns + 16 * m + g, 4 * s + t);
        const uint4 b = LoadStaged(stage, kSampleColumns + 16 * m + g + 8, 4 * s + t);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          MmaBf16(acc[m][j], a.x, b.x, a.y, b.y, w[j].x, w[j].y);
          MmaBf16(acc[m][j], a.z, b.z, a.w, b.w, w[j].z, w[j].w);
        }
      }
    }
  }

  // acc[m][j][e] is row 16 m + g (e < 2) or + 8, column
  // 32 warp + 8 j + 2 t + e % 2; it becomes z in place.
  float sum[2 * kMTiles] = {};
  float inv_t[2 * kMTiles];
#pragma unroll
  for (int i = 0; i < 2 * kMTiles; ++i) {
    const int r = min(row0 + 16 * (i / 2) + 8 * (i % 2) + g, p.rows - 1);
    inv_t[i] = 1.0f / (p.temperatures != nullptr ? p.temperatures[r] : p.temperature);
  }
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = 32 * warp + 8 * j + 2 * t + (e & 1);
        const float bias = p.sample_bias != nullptr ? p.sample_bias[v] : 0.0f;
        acc[m][j][e] = (acc[m][j][e] + bias) * inv_t[2 * m + e / 2];
        sum[2 * m + e / 2] += acc[m][j][e];
      }
    }
  }
  BlockRowSums<kMTiles>(sum, part, sums);
  float mean[2 * kMTiles], sq[2 * kMTiles] = {};
#pragma unroll
  for (int i = 0; i < 2 * kMTiles; ++i) {
    mean[i] = sums[16 * (i / 2) + 8 * (i % 2) + g] / kSampleColumns;
  }
  __syncthreads();  // sums is reused
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float d = acc[m][j][e] - mean[2 * m + e / 2];
        sq[2 * m + e / 2] += d * d;
      }
    }
  }
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

// Lets both block shapes take their shared memory (once per device).
static inline cudaError_t PrepareFloorKernels() {
  if (cudaError_t e = cudaFuncSetAttribute(
          TopKFloorKernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
          kSmemBytes<1>);
      e != cudaSuccess) {
    return e;
  }
  return cudaFuncSetAttribute(TopKFloorKernel<2>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              kSmemBytes<2>);
}

// Blocks of 16 rows while they fit in one wave (num_sms), else of 32.
static inline cudaError_t EnqueueFloorKernel(const FloorParams& p, int num_sms,
                                             cudaStream_t stream) {
  if (p.rows > 16 * num_sms) {
    TopKFloorKernel<2><<<static_cast<unsigned>((p.rows + 31) / 32), kThreads,
                         kSmemBytes<2>, stream>>>(p);
  } else {
    TopKFloorKernel<1><<<static_cast<unsigned>((p.rows + 15) / 16), kThreads,
                         kSmemBytes<1>, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace detlogp::kernels::cuda::floors

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_FLOOR_KERNEL_CUH_
