// Kernel version sm90a-wgmma-v3: batch-invariant fused linear + log-softmax
// gather for Hopper (sm_90a). Included by linear_logp_cuda.cu only.
//
// Work decomposition (see docs/kernels.md, "Hopper kernel"):
//   * A work item is (row block of kBlockM = 128 rows, vocabulary split s).
//     Splits come from a table the host fills; in the batch-invariant mode it
//     is kernels/split_policy.h's VocabSplitRange(V, s), a function of V alone.
//   * A persistent grid walks the items statically (block b takes items b,
//     b + gridDim.x, ...). Which block computes an item never changes its
//     bits: every item is computed by the same instruction sequence.
//   * Inside an item the split is walked in ascending vocabulary order in
//     ceil(S / 256) tiles (S = split size) whose widths are multiples of 32,
//     spread as evenly as possible, wider first (TileWidth). The widths depend
//     only on the split boundaries (a function of V in the invariant mode), so
//     a given logit is always produced by the same wgmma shape (m64nWk16,
//     W in {32, 64, ..., 256}) and the same K order (k = 0, 16, ... H-16).
//     Row position and N never enter. (v1 used 256-wide tiles plus one narrow
//     remainder tile per split; the narrow tiles ran at lower efficiency.)
//   * The hidden-state TMA box is min(128, N rounded up to 8) rows, so small
//     batches do not pay for out-of-bounds fill; smem rows past the box hold
//     stale data that only feeds rows >= N, which are never written.
//   * Warpgroup 0 is the producer (one thread issues TMA loads into a
//     kStages-deep ring guarded by full/empty mbarriers); warpgroups 1 and 2
//     are consumers, each owning 64 rows of the 128-row block. A consumer
//     whose 64 rows are all >= N skips its wgmmas (its rows are never
//     written), which changes no other row's arithmetic.
//   * After each tile a consumer folds the accumulator fragment into a
//     per-row online softmax state (max, sum of exp(z - max)) with a fixed
//     sequence: per-thread in fixed column order, then a fixed xor-shuffle
//     reduction across the 4 threads that share a row. The state is written
//     once per (row, split) to the workspace as the split's logsumexp
//     lse_s = max + log(sum) (4 bytes; the partial {lse_s, 1} is equivalent
//     to {max, sum}); the split holding the target writes z[target] into
//     logprobs[row]. A second kernel folds the partials {lse_s, 1} in
//     ascending split order with CombinePartials, starting from split 0, and
//     finishes logprob = z[target] - lse. No atomics anywhere.
//   * The epilogue computes y = acc + bias; the tile max of z = y / T is
//     fl(max(y) * (1/T)) (rounding is monotone, 1/T > 0), exp(z - m) is
//     ex2(y * (log2e / T) - m * log2e), and z[target] = y * (1/T).
//
// Entropy and top-k are compile-time variants of the same kernel
// (kEntropy, kTopK). The logprob/lse arithmetic is the same instruction
// sequence in every variant, so asking for extras never changes those bits:
//   * entropy: next to sum = sum exp(z - m), each split also accumulates
//     t = sum exp(z - m) * y (y = acc + bias, z = y / T) with the same
//     rescaling, and stores the split's mean z = (t / sum) / T. The combine
//     folds {lse_s, 1, mean_s} in ascending split order with the lse fold's
//     rescaling (softmax_partial.h): entropy = lse - Z / S, Z and S the
//     folded sums of the splits' mean z and of their exp weights.
//   * top-k (linear_logp_topk.cuh, shared with the portable kernel): each
//     (row, split) keeps a sorted list of the k best (z, id) in shared
//     memory under RanksBefore (a total order, so the list is one set
//     whatever order candidates arrive in). A tile's values are screened
//     against bounds on the row's k-th best (the list's worst entry, the
//     tile's own, and what the row's other splits published in the
//     workspace), each survivor inserted by the whole warp at once; the
//     tile is screened right after its maxima pass, which hands over its
//     group maxima, and before its exp sums (FoldTileScreenedFirst). Every
//     fragment index is a compile-time constant (a run-time index into the
//     accumulators is a divergent indirect branch). Lists go to the
//     workspace per (row, split); the combine merges them. The output
//     depends on the row alone (the screens never drop a top-k value).
// The version string covers the extras too: any change to their arithmetic
// must bump it.
//
// Version history (CHANGELOG.md; earlier kernels in `git log -- kernels/cuda`):
//   v1: 256-wide tiles + one narrow tail tile per split, 128-row A box,
//       {max, sum} partials.
//   v2: even 32-multiple tile widths, A box sized to N (small-N speed).
//   v3: split policy max132/v2, 4-byte split logsumexp, cheaper epilogue.
// Build flags matter for bits: -O3 -gencode=arch=compute_90a,code=sm_90a,
// no --use_fast_math / -ftz / -prec-div changes (expf/logf in the combine).
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_KERNEL_CUH_

#include <cuda.h>
#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/hopper_ptx.cuh"
#include "kernels/cuda/linear_logp_epilogue.cuh"
#include "kernels/item_order.h"
#include "kernels/softmax_partial.h"

namespace detlogp::kernels::cuda::v3 {

using detlogp::kernels::RowBlockAndSplit;
using epilogue::RowState;
using epilogue::TopKLists;

inline constexpr char kVersion[] = "sm90a-wgmma-v3";

inline constexpr int kBlockM = 128;    // rows per item (2 x 64)
inline constexpr int kBlockN = 256;    // widest vocabulary tile
inline constexpr int kBlockK = 64;     // 128 bytes of bf16: one swizzle row
inline constexpr int kChunkRows = 32;  // weight rows per TMA box
inline constexpr int kStages = 4;
inline constexpr int kConsumers = 2;
inline constexpr int kThreads = 128 * (1 + kConsumers);
inline constexpr int kATileBytes = kBlockM * kBlockK * 2;      // 16 KiB
inline constexpr int kBTileBytes = kBlockN * kBlockK * 2;      // 32 KiB
inline constexpr int kBChunkBytes = kChunkRows * kBlockK * 2;  // 4 KiB
inline constexpr int kMaxSplits = 256;  // 4 B per split: <= 1 KiB per row
inline constexpr int kSmemBytes =
    1024 + kStages * (kATileBytes + kBTileBytes) + 2 * kStages * 8;
// Top-k lists: kBlockM rows x kMaxTopK (z, id) pairs after the barriers.
inline constexpr int kMaxTopK = 32;
inline constexpr int kTopKSmemBytes =
    epilogue::TopKListBytes(kBlockM, kMaxTopK);
inline constexpr int kSmemBytesTopK = kSmemBytes + kTopKSmemBytes;
inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;

struct KernelParams {
  const float* bias;          // [padded_vocab] or null
  const int32_t* targets;     // [rows], or null: targets64
  const int64_t* targets64;   // [rows] when targets is null
  const float* temperatures;  // [rows], or null: temperature
  float temperature;          // every row's, when temperatures is null
  float* logprobs;            // [rows]: z[target] here, then logprob
  float* split_lse;           // [rows][num_splits]: logsumexp of split
  float* split_mean_z;        // [rows][num_splits] (kEntropy)
  float* split_top_z;         // [rows][num_splits][top_k] (kTopK)
  int32_t* split_top_id;      // [rows][num_splits][top_k] (kTopK)
  uint32_t* top_screen;       // [rows][kScreenWords], zeroed, or null
  int32_t top_k;              // 1..kMaxTopK (kTopK)
  int32_t id_offset;          // added to top-k ids (a shard's first row)
  int32_t rows;
  int32_t k_blocks;  // hidden / 64
  int32_t num_splits;
  int32_t num_row_blocks;
  int32_t num_items;
  int32_t row_group;   // DecodeItem's group (kernels/item_order.h)
  int32_t a_box_rows;  // hidden rows per TMA box (<= kBlockM)
  // kTopK: null, or a rerun pass (linear_logp_floor_kernel.cuh): only the
  // row blocks b with rerun_blocks[b] != 0 are computed, none when
  // rerun_blocks[num_row_blocks] (set with any) is 0.
  const int32_t* rerun_blocks;
  int32_t split_begin[kMaxSplits + 1];  // split s is [begin[s], begin[s+1])
};

// A row's target as the split pass compares it with its columns: int64
// targets outside the int32 range become one no split holds.
__device__ __forceinline__ int RowTarget(const KernelParams& p, int r) {
  if (p.targets != nullptr) return p.targets[r];
  const int64_t t = p.targets64[r];
  return (t >= 0 && t <= INT32_MAX) ? static_cast<int>(t) : -(1 << 30);
}

__device__ __forceinline__ float RowTemperature(const KernelParams& p, int r) {
  return p.temperatures != nullptr ? p.temperatures[r] : p.temperature;
}

// Item -> (row block, split), in kernels/item_order.h's order.
__device__ __forceinline__ void DecodeItem(const KernelParams& p, int item,
                                           int& row_block, int& split) {
  const RowBlockAndSplit rs = detlogp::kernels::DecodeItem(
      item, p.num_row_blocks, p.num_splits, p.row_group);
  row_block = rs.row_block;
  split = rs.split;
}

// Tiling of a split of `size` columns: ceil(size / 256) tiles whose widths are
// multiples of 32 spread as evenly as possible, wider tiles first. A function
// of the split boundaries alone.
__host__ __device__ __forceinline__ int TileCount(int size) {
  const int units = (size + 31) / 32;
  return (units + 7) / 8;
}
__host__ __device__ __forceinline__ int TileWidth(int size, int tile) {
  const int units = (size + 31) / 32;
  const int tiles = (units + 7) / 8;
  const int base = units / tiles;
  const int rem = units - base * tiles;
  return 32 * (base + (tile < rem ? 1 : 0));
}

template <int kW>
__device__ __forceinline__ void Wgmma(float* acc, uint64_t da, uint64_t db,
                                      int scale_d) {
  if constexpr (kW == 256) {
    ptx::WgmmaM64N256K16(acc, da, db, scale_d);
  } else if constexpr (kW == 224) {
    ptx::WgmmaM64N224K16(acc, da, db, scale_d);
  } else if constexpr (kW == 192) {
    ptx::WgmmaM64N192K16(acc, da, db, scale_d);
  } else if constexpr (kW == 160) {
    ptx::WgmmaM64N160K16(acc, da, db, scale_d);
  } else if constexpr (kW == 128) {
    ptx::WgmmaM64N128K16(acc, da, db, scale_d);
  } else if constexpr (kW == 96) {
    ptx::WgmmaM64N96K16(acc, da, db, scale_d);
  } else if constexpr (kW == 64) {
    ptx::WgmmaM64N64K16(acc, da, db, scale_d);
  } else {
    static_assert(kW == 32, "tile widths are multiples of 32");
    ptx::WgmmaM64N32K16(acc, da, db, scale_d);
  }
}

// Per-thread view of the two rows it owns in a 64-row consumer slab.
struct ConsumerRows {
  int row[2];
  float inv_t[2];
  int target[2];
};

using Ring = ptx::StageRing<kStages>;

// Main loop over K for one vocabulary tile of width kW, then the online
// softmax fold of the tile into `state`.
template <int kW, bool kEntropy, bool kTopK>
__device__ __forceinline__ void ConsumeTile(
    const KernelParams& p, float* acc, uint8_t* smem_a, uint8_t* smem_b,
    uint64_t* full, uint64_t* empty, Ring& ring, bool active, int consumer,
    int lane, int v0, int valid, const ConsumerRows& rows, RowState* state,
    const TopKLists& lists) {
  constexpr int kRegs = kW / 2;
  const bool lane_arrives = lane == 0;
  int prev_stage = -1;
  // The rows' shared top-k screens, loaded before the tile's K loop: loaded
  // at the fold, their L2 round trip stalled every tile (ncu: long
  // scoreboard stalls 1.9 -> 3.2 cycles per issue with top-k). Read a K
  // loop earlier, a screen can only be looser, never wrong. Kept as keys
  // until the fold: converted here, they made the warp wait out the round
  // trip before its K loop (ncu: ~1 % of the kernel's samples).
  uint32_t screen_keys[2] = {0, 0};
  if constexpr (kTopK) {
    const epilogue::TopKParams top{p.top_screen, p.top_k, p.id_offset, p.rows};
    screen_keys[0] = epilogue::LoadRowScreenKey(top, rows.row[0]);
    screen_keys[1] = epilogue::LoadRowScreenKey(top, rows.row[1]);
  }
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

  const epilogue::EpilogueParams ep{
      p.bias, p.logprobs, {p.top_screen, p.top_k, p.id_offset, p.rows}};
  if constexpr (kTopK) {
    epilogue::FoldTileScreenedFirst<kW, kEntropy>(
        ep, acc, lane, v0, valid, rows.row, rows.inv_t, rows.target, state,
        lists, screen_keys);
  } else {
    epilogue::FoldTile<kW, kEntropy, false>(ep, acc, lane, v0, valid, rows.row,
                                            rows.inv_t, rows.target, state,
                                            lists);
  }
}

// A rerun pass leaves the row blocks that were not marked alone.
template <bool kTopK>
__device__ __forceinline__ bool SkipsItem(const KernelParams& p,
                                          int row_block) {
  if constexpr (kTopK) {
    return p.rerun_blocks != nullptr && p.rerun_blocks[row_block] == 0;
  } else {
    return false;
  }
}

template <bool kEntropy, bool kTopK>
__global__ void __launch_bounds__(kThreads, 1)
    LinearLogpSplitKernel(const __grid_constant__ CUtensorMap hidden_map,
                          const __grid_constant__ CUtensorMap weight_map,
                          const __grid_constant__ KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem + kStages * kATileBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_b + kStages * kBTileBytes);
  uint64_t* empty = full + kStages;
  float* top_z = reinterpret_cast<float*>(empty + kStages);
  int32_t* top_id = reinterpret_cast<int32_t*>(top_z + kBlockM * kMaxTopK);

  if constexpr (kTopK) {
    if (p.rerun_blocks != nullptr && p.rerun_blocks[p.num_row_blocks] == 0) {
      return;  // a rerun pass with nothing to rerun: every thread leaves
    }
  }
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
    Ring ring;
    for (int item = blockIdx.x; item < p.num_items; item += gridDim.x) {
      int row_block, split;
      DecodeItem(p, item, row_block, split);
      if (SkipsItem<kTopK>(p, row_block)) continue;
      const int begin = p.split_begin[split];
      const int end = p.split_begin[split + 1];
      const int tiles = TileCount(end - begin);
      for (int t = 0, v0 = begin; t < tiles; ++t) {
        const int width = TileWidth(end - begin, t);
        const int chunks = width / kChunkRows;
        const uint32_t bytes =
            p.a_box_rows * (kBlockK * 2) + chunks * kBChunkBytes;
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
        v0 += width;
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
  Ring ring;
  for (int item = blockIdx.x; item < p.num_items; item += gridDim.x) {
    int row_block, split;
    DecodeItem(p, item, row_block, split);
    if (SkipsItem<kTopK>(p, row_block)) continue;  // as the producer does
    const int begin = p.split_begin[split];
    const int end = p.split_begin[split + 1];
    const int slab = row_block * kBlockM + consumer * 64;
    const bool active = slab < p.rows;
    ConsumerRows rows;
    RowState state[2];
    // The warp's rows' top-k lists, emptied for this item.
    const TopKLists lists = epilogue::MakeTopKLists(
        top_z, top_id, consumer * 64 + warp * 16, kBlockM);
    if constexpr (kTopK) epilogue::TopKReset(lists, p.top_k, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = slab + warp * 16 + (lane >> 2) + 8 * h;
      rows.row[h] = r;
      const bool in = r < p.rows;
      rows.inv_t[h] = in ? __frcp_rn(RowTemperature(p, r)) : 1.0f;
      rows.target[h] = in ? RowTarget(p, r) : -(1 << 30);
      state[h] = RowState{-INFINITY, 0.0f, 0.0f, -INFINITY};
    }
    const int tiles = TileCount(end - begin);
    for (int t = 0, v0 = begin; t < tiles; ++t) {
      const int width = TileWidth(end - begin, t);
      const int valid = end - v0;
      switch (width / kChunkRows) {
        case 8:
          ConsumeTile<256, kEntropy, kTopK>(p, acc, smem_a, smem_b, full, empty,
                                            ring, active, consumer, lane, v0,
                                            valid, rows, state, lists);
          break;
        case 7:
          ConsumeTile<224, kEntropy, kTopK>(p, acc, smem_a, smem_b, full, empty,
                                            ring, active, consumer, lane, v0,
                                            valid, rows, state, lists);
          break;
        case 6:
          ConsumeTile<192, kEntropy, kTopK>(p, acc, smem_a, smem_b, full, empty,
                                            ring, active, consumer, lane, v0,
                                            valid, rows, state, lists);
          break;
        case 5:
          ConsumeTile<160, kEntropy, kTopK>(p, acc, smem_a, smem_b, full, empty,
                                            ring, active, consumer, lane, v0,
                                            valid, rows, state, lists);
          break;
        case 4:
          ConsumeTile<128, kEntropy, kTopK>(p, acc, smem_a, smem_b, full, empty,
                                            ring, active, consumer, lane, v0,
                                            valid, rows, state, lists);
          break;
        case 3:
          ConsumeTile<96, kEntropy, kTopK>(p, acc, smem_a, smem_b, full, empty,
                                           ring, active, consumer, lane, v0,
                                           valid, rows, state, lists);
          break;
        case 2:
          ConsumeTile<64, kEntropy, kTopK>(p, acc, smem_a, smem_b, full, empty,
                                           ring, active, consumer, lane, v0,
                                           valid, rows, state, lists);
          break;
        case 1:
          ConsumeTile<32, kEntropy, kTopK>(p, acc, smem_a, smem_b, full, empty,
                                           ring, active, consumer, lane, v0,
                                           valid, rows, state, lists);
          break;
        default:
          __trap();  // unreachable: widths are 32..256
      }
      v0 += width;
    }
    if (active && (lane & 3) == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (rows.row[h] < p.rows) {
          epilogue::StoreSplitPartials(
              p.split_lse, kEntropy ? p.split_mean_z : nullptr,
              static_cast<int64_t>(rows.row[h]) * p.num_splits + split,
              state[h], rows.inv_t[h]);
        }
      }
    }
    if constexpr (kTopK) {
      if (active) {
        epilogue::StoreTopKLists(
            lists, p.top_k, lane, static_cast<int64_t>(row_block) * kBlockM,
            p.rows, p.num_splits, split, p.split_top_z, p.split_top_id);
      }
    }
  }
}

}  // namespace detlogp::kernels::cuda::v3

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_KERNEL_CUH_
