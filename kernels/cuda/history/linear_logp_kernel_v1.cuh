// Kernel version sm90a-wgmma-v1: batch-invariant fused linear + log-softmax
// gather for Hopper (sm_90a). Included by linear_logp_cuda.cu only.
//
// Work decomposition (see docs/perf.md, "Fused linear-logp (CUDA)"):
//   * A work item is (row block of kBlockM = 128 rows, vocabulary split s).
//     Splits come from a table the host fills; in the batch-invariant mode it
//     is kernels/split_policy.h's VocabSplitRange(V, s), a function of V alone.
//   * A persistent grid walks the items statically (block b takes items b,
//     b + gridDim.x, ...). Which block computes an item never changes its
//     bits: every item is computed by the same instruction sequence.
//   * Inside an item the split is walked in ascending vocabulary order in
//     tiles of up to kBlockN = 256 columns. A tile's width is 64 * chunks,
//     where chunks depends only on the split boundaries (a function of V in
//     the invariant mode), so a given logit is always produced by the same
//     wgmma shape (m64nWk16, W in {64,128,192,256}) and the same K order
//     (k = 0, 16, 32, ... H-16). Row position and N never enter.
//   * Warpgroup 0 is the producer (one thread issues TMA loads into a
//     kStages-deep ring guarded by full/empty mbarriers); warpgroups 1 and 2
//     are consumers, each owning 64 rows of the 128-row block. A consumer
//     whose 64 rows are all >= N skips its wgmmas (its rows are never
//     written), which changes no other row's arithmetic.
//   * After each tile a consumer folds the accumulator fragment into a
//     per-row online softmax state (max, sum of exp(z - max)) with a fixed
//     sequence: per-thread in fixed column order, then a fixed xor-shuffle
//     reduction across the 4 threads that share a row. The state is written
//     once per (row, split) to the workspace; the split holding the target
//     writes z[target] into logprobs[row]. A second kernel folds the
//     partials in ascending split order (CombinePartials) and finishes
//     logprob = z[target] - lse.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_KERNEL_CUH_

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/hopper_ptx.cuh"
#include "kernels/softmax_partial.h"

namespace detlogp::kernels::cuda::v1 {

inline constexpr char kVersion[] = "sm90a-wgmma-v1";

inline constexpr int kBlockM = 128;         // rows per item (2 x 64)
inline constexpr int kBlockN = 256;         // widest vocabulary tile
inline constexpr int kBlockK = 64;          // 128 bytes of bf16: one swizzle row
inline constexpr int kChunkRows = 64;       // weight rows per TMA box
inline constexpr int kStages = 4;
inline constexpr int kConsumers = 2;
inline constexpr int kThreads = 128 * (1 + kConsumers);
inline constexpr int kATileBytes = kBlockM * kBlockK * 2;     // 16 KiB
inline constexpr int kBTileBytes = kBlockN * kBlockK * 2;     // 32 KiB
inline constexpr int kBChunkBytes = kChunkRows * kBlockK * 2;  // 8 KiB
inline constexpr int kMaxSplits = 128;
inline constexpr int kRowGroup = 8;  // row blocks that share weight tiles in L2
inline constexpr int kSmemBytes =
    1024 + kStages * (kATileBytes + kBTileBytes) + 2 * kStages * 8;
inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;

struct KernelParams {
  const float* bias;             // [padded_vocab] or null
  const int32_t* targets;        // [rows]
  const float* temperatures;     // [rows]
  float* logprobs;               // [rows]: z[target] here, then logprob
  SoftmaxPartial* partials;      // [rows][num_splits]
  int32_t rows;
  int32_t k_blocks;              // hidden / 64
  int32_t num_splits;
  int32_t num_row_blocks;
  int32_t num_items;
  int32_t split_begin[kMaxSplits + 1];  // split s is [begin[s], begin[s+1])
};

// Item -> (row block, split). Row blocks are taken kRowGroup at a time, with
// the row block fastest inside a group, so concurrent blocks share weights.
__device__ __forceinline__ void DecodeItem(const KernelParams& p, int item,
                                           int& row_block, int& split) {
  const int group_items = kRowGroup * p.num_splits;
  const int g = item / group_items;
  const int r = item - g * group_items;
  const int in_group = min(kRowGroup, p.num_row_blocks - g * kRowGroup);
  split = r / in_group;
  row_block = g * kRowGroup + (r - split * in_group);
}

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int kW>
__device__ __forceinline__ void Wgmma(float* acc, uint64_t da, uint64_t db,
                                      int scale_d) {
  if constexpr (kW == 256) {
    ptx::WgmmaM64N256K16(acc, da, db, scale_d);
  } else if constexpr (kW == 192) {
    ptx::WgmmaM64N192K16(acc, da, db, scale_d);
  } else if constexpr (kW == 128) {
    ptx::WgmmaM64N128K16(acc, da, db, scale_d);
  } else {
    ptx::WgmmaM64N64K16(acc, da, db, scale_d);
  }
}

struct RowState {
  float max;
  float sum;
};

// Per-thread view of the two rows it owns in a 64-row consumer slab.
struct ConsumerRows {
  int row[2];
  float inv_t[2];
  int target[2];
};

struct Ring {
  int stage;
  uint32_t phase;
  __device__ __forceinline__ void Advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Main loop over K for one vocabulary tile of width kW, then the online
// softmax fold of the tile into `state`.
template <int kW>
__device__ __forceinline__ void ConsumeTile(
    const KernelParams& p, float* acc, uint8_t* smem_a, uint8_t* smem_b,
    uint64_t* full, uint64_t* empty, Ring& ring, bool active, int consumer,
    int lane, int v0, int valid, const ConsumerRows& rows, RowState* state) {
  constexpr int kRegs = kW / 2;
  const bool lane_arrives = lane == 0;
  int prev_stage = -1;
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    ptx::MbarWait(&full[ring.stage], ring.phase);
    if (active) {
      const uint32_t a_addr = ptx::SmemAddr(smem_a + ring.stage * kATileBytes +
                                            consumer * (kATileBytes / 2));
      const uint32_t b_addr = ptx::SmemAddr(smem_b + ring.stage * kBTileBytes);
      const uint64_t da = ptx::MakeSmemDescSw128(a_addr);
      const uint64_t db = ptx::MakeSmemDescSw128(b_addr);
      ptx::WgmmaFence();
#pragma unroll
      for (int k = 0; k < kBlockK / 16; ++k) {
        Wgmma<kW>(acc, da + 2 * k, db + 2 * k, (kb | k) != 0);
      }
      ptx::WgmmaCommit();
      ptx::WgmmaWait<1>();
      if (prev_stage >= 0 && lane_arrives) ptx::MbarArrive(&empty[prev_stage]);
      prev_stage = ring.stage;
    } else if (lane_arrives) {
      ptx::MbarArrive(&empty[ring.stage]);
    }
    ring.Advance();
  }
  ptx::WgmmaWait<0>();  // no-op when inactive (nothing was issued)
  ptx::FenceAccumulators<kRegs>(acc);
  if (!active) return;
  if (lane_arrives) ptx::MbarArrive(&empty[prev_stage]);

  // ---- epilogue: z = (acc + bias) / T, online softmax over the tile.
  constexpr float kLog2e = 1.4426950408889634f;
  const int quad = lane & 3;
  const int limit = valid < kW ? valid : kW;
  const int tcol0 = rows.target[0] - v0;
  const int tcol1 = rows.target[1] - v0;
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < kW / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * quad + e;
      const bool ok = col < limit;
      float b = 0.0f;
      if (p.bias != nullptr && ok) b = __ldg(p.bias + v0 + col);
      float z0 = (acc[4 * j + e] + b) * rows.inv_t[0];
      float z1 = (acc[4 * j + 2 + e] + b) * rows.inv_t[1];
      z0 = ok ? z0 : -INFINITY;
      z1 = ok ? z1 : -INFINITY;
      if (col == tcol0 && ok) p.logprobs[rows.row[0]] = z0;
      if (col == tcol1 && ok) p.logprobs[rows.row[1]] = z1;
      acc[4 * j + e] = z0;
      acc[4 * j + 2 + e] = z1;
      mx0 = fmaxf(mx0, z0);
      mx1 = fmaxf(mx1, z1);
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float m0 = fmaxf(state[0].max, mx0);
  const float m1 = fmaxf(state[1].max, mx1);
  const float c0 = -m0 * kLog2e;
  const float c1 = -m1 * kLog2e;
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int j = 0; j < kW / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s0 += Ex2(fmaf(acc[4 * j + e], kLog2e, c0));
      s1 += Ex2(fmaf(acc[4 * j + 2 + e], kLog2e, c1));
    }
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  state[0].sum = state[0].sum * Ex2((state[0].max - m0) * kLog2e) + s0;
  state[1].sum = state[1].sum * Ex2((state[1].max - m1) * kLog2e) + s1;
  state[0].max = m0;
  state[1].max = m1;
}

__global__ void __launch_bounds__(kThreads, 1)
    LinearLogpSplitKernel(const __grid_constant__ CUtensorMap hidden_map,
                          const __grid_constant__ CUtensorMap weight_map,
                          const __grid_constant__ KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem + kStages * kATileBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(
      smem_b + kStages * kBTileBytes);
  uint64_t* empty = full + kStages;

  // Broadcast so that the compiler sees a warp-uniform value (keeps the wgmma
  // paths free of divergence, which would serialize them).
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if (threadIdx.x == 0) {
    ptx::PrefetchTensorMap(&hidden_map);
    ptx::PrefetchTensorMap(&weight_map);
    for (int s = 0; s < kStages; ++s) {
      ptx::MbarInit(&full[s], 1);
      ptx::MbarInit(&empty[s], kConsumers * 4);
    }
    ptx::FenceBarrierInit();
  }
  __syncthreads();

  if (warpgroup == 0) {
    ptx::SetMaxNRegDec<kProducerRegs>();
    if (threadIdx.x != 0) return;
    Ring ring{0, 0};
    for (int item = blockIdx.x; item < p.num_items; item += gridDim.x) {
      int row_block, split;
      DecodeItem(p, item, row_block, split);
      const int begin = p.split_begin[split];
      const int end = p.split_begin[split + 1];
      for (int v0 = begin; v0 < end; v0 += kBlockN) {
        const int chunks = min(kBlockN / kChunkRows,
                               (end - v0 + kChunkRows - 1) / kChunkRows);
        const uint32_t bytes = kATileBytes + chunks * kBChunkBytes;
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          ptx::MbarWait(&empty[ring.stage], ring.phase ^ 1u);
          ptx::MbarArriveExpectTx(&full[ring.stage], bytes);
          ptx::TmaLoad2d(smem_a + ring.stage * kATileBytes, &hidden_map,
                         &full[ring.stage], kb * kBlockK, row_block * kBlockM);
          for (int c = 0; c < chunks; ++c) {
            ptx::TmaLoad2d(smem_b + ring.stage * kBTileBytes + c * kBChunkBytes,
                           &weight_map, &full[ring.stage], kb * kBlockK,
                           v0 + c * kChunkRows);
          }
          ring.Advance();
        }
      }
    }
    return;
  }

  ptx::SetMaxNRegInc<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int tid = threadIdx.x & 127;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  float acc[kBlockN / 2];
  Ring ring{0, 0};
  for (int item = blockIdx.x; item < p.num_items; item += gridDim.x) {
    int row_block, split;
    DecodeItem(p, item, row_block, split);
    const int begin = p.split_begin[split];
    const int end = p.split_begin[split + 1];
    const int slab = row_block * kBlockM + consumer * 64;
    const bool active = slab < p.rows;
    ConsumerRows rows;
    RowState state[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = slab + warp * 16 + (lane >> 2) + 8 * h;
      rows.row[h] = r;
      const bool in = r < p.rows;
      rows.inv_t[h] = in ? __frcp_rn(p.temperatures[r]) : 1.0f;
      rows.target[h] = in ? p.targets[r] : -(1 << 30);
      state[h] = RowState{-INFINITY, 0.0f};
    }
    for (int v0 = begin; v0 < end; v0 += kBlockN) {
      const int valid = end - v0;
      const int chunks = min(kBlockN / kChunkRows,
                             (valid + kChunkRows - 1) / kChunkRows);
      switch (chunks) {
        case 4:
          ConsumeTile<256>(p, acc, smem_a, smem_b, full, empty, ring, active,
                           consumer, lane, v0, valid, rows, state);
          break;
        case 3:
          ConsumeTile<192>(p, acc, smem_a, smem_b, full, empty, ring, active,
                           consumer, lane, v0, valid, rows, state);
          break;
        case 2:
          ConsumeTile<128>(p, acc, smem_a, smem_b, full, empty, ring, active,
                           consumer, lane, v0, valid, rows, state);
          break;
        default:
          ConsumeTile<64>(p, acc, smem_a, smem_b, full, empty, ring, active,
                          consumer, lane, v0, valid, rows, state);
          break;
      }
    }
    if (active && (lane & 3) == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (rows.row[h] < p.rows) {
          p.partials[static_cast<int64_t>(rows.row[h]) * p.num_splits + split] =
              SoftmaxPartial{state[h].max, state[h].sum};
        }
      }
    }
  }
}

// Folds each row's split partials in ascending split order, starting from
// split 0, and finishes logprob = z[target] - lse. One thread per row: the
// fold order is fixed and independent of the launch shape.
__global__ void CombineKernel(const SoftmaxPartial* __restrict__ partials,
                              int32_t num_splits, int32_t rows,
                              float* __restrict__ logprobs,
                              float* __restrict__ lse) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const SoftmaxPartial* row = partials + static_cast<int64_t>(r) * num_splits;
  SoftmaxPartial acc = row[0];
  for (int s = 1; s < num_splits; ++s) acc = CombinePartials(acc, row[s]);
  const float l = PartialLogSumExp(acc);
  lse[r] = l;
  logprobs[r] = logprobs[r] - l;
}

}  // namespace detlogp::kernels::cuda::v1

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_KERNEL_CUH_
