// Kernel version sm90a-wgmma-v3: batch-invariant fused linear + log-softmax
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
// Entropy and top-k (issue #11) are compile-time variants of the same kernel
// (kEntropy, kTopK). The logprob/lse arithmetic is the same instruction
// sequence in every variant, so asking for extras never changes those bits:
//   * entropy: next to sum = sum exp(z - m), each split also accumulates
//     t = sum exp(z - m) * y (y = acc + bias, z = y / T) with the same
//     rescaling, and stores the split's mean z = (t / sum) / T. The combine
//     folds {lse_s, 1, mean_s} in ascending split order with the lse fold's
//     rescaling (softmax_partial.h): entropy = lse - Z / S, Z and S the
//     folded sums of the splits' mean z and of their exp weights.
//   * top-k: each (row, split) keeps a sorted list of the k best (z, id) in
//     shared memory under RanksBefore (a total order, so the list is one set
//     whatever order candidates arrive in). A tile's values are screened
//     against the list's worst entry and a lower bound on the tile's own
//     k-th best (the least of kW / 8 disjoint 8-value group maxima); each
//     survivor is inserted by the whole warp at once (lane i holds entry i:
//     a ballot finds its place, a shuffle moves the tail), and the row's
//     screen tightens to the new worst entry. Every fragment index is a
//     compile-time constant (a run-time index into the accumulators is a
//     divergent indirect branch). Lists go to the workspace per (row,
//     split); the combine merges them.
// The version string covers the extras too: any change to their arithmetic
// must bump it.
//
// Version history (docs/perf.md; earlier kernels in `git log -- kernels/cuda`):
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
#include "kernels/softmax_partial.h"

namespace detlogp::kernels::cuda::v3 {

inline constexpr char kVersion[] = "sm90a-wgmma-v3";

inline constexpr int kBlockM = 128;         // rows per item (2 x 64)
inline constexpr int kBlockN = 256;         // widest vocabulary tile
inline constexpr int kBlockK = 64;          // 128 bytes of bf16: one swizzle row
inline constexpr int kChunkRows = 32;       // weight rows per TMA box
inline constexpr int kStages = 4;
inline constexpr int kConsumers = 2;
inline constexpr int kThreads = 128 * (1 + kConsumers);
inline constexpr int kATileBytes = kBlockM * kBlockK * 2;     // 16 KiB
inline constexpr int kBTileBytes = kBlockN * kBlockK * 2;     // 32 KiB
inline constexpr int kBChunkBytes = kChunkRows * kBlockK * 2;  // 4 KiB
inline constexpr int kMaxSplits = 256;  // 4 B per split: <= 1 KiB per row
inline constexpr int kRowGroup = 8;  // row blocks that share weight tiles in L2
inline constexpr int kSmemBytes =
    1024 + kStages * (kATileBytes + kBTileBytes) + 2 * kStages * 8;
// Top-k lists: kBlockM rows x kMaxTopK (z, id) pairs after the barriers.
inline constexpr int kMaxTopK = 32;
inline constexpr int kTopKSmemBytes = kBlockM * kMaxTopK * 8;
inline constexpr int kSmemBytesTopK = kSmemBytes + kTopKSmemBytes;
inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;

struct KernelParams {
  const float* bias;             // [padded_vocab] or null
  const int32_t* targets;        // [rows], or null: targets64
  const int64_t* targets64;      // [rows] when targets is null
  const float* temperatures;     // [rows], or null: temperature
  float temperature;             // every row's, when temperatures is null
  float* logprobs;               // [rows]: z[target] here, then logprob
  float* split_lse;              // [rows][num_splits]: logsumexp of split
  float* split_mean_z;           // [rows][num_splits] (kEntropy)
  float* split_top_z;            // [rows][num_splits][top_k] (kTopK)
  int32_t* split_top_id;         // [rows][num_splits][top_k] (kTopK)
  int32_t top_k;                 // 1..kMaxTopK (kTopK)
  int32_t id_offset;             // added to top-k ids (a shard's first row)
  int32_t rows;
  int32_t k_blocks;              // hidden / 64
  int32_t num_splits;
  int32_t num_row_blocks;
  int32_t num_items;
  int32_t a_box_rows;             // hidden rows per TMA box (<= kBlockM)
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

// acc[4 * j + k] for a run-time j < kJ and compile-time-free k in [0, 4),
// through a switch so that the accumulators stay in registers (a select
// chain gets turned into a local-memory array by the compiler).
template <int kJ>
__device__ __forceinline__ float SelectFragment(const float* acc, int j, int k) {
  float v[4];
  switch (j) {
#define DETLOGP_CASE(J)                                 \
  case J:                                               \
    if constexpr (J < kJ) {                             \
      v[0] = acc[4 * J + 0];                            \
      v[1] = acc[4 * J + 1];                            \
      v[2] = acc[4 * J + 2];                            \
      v[3] = acc[4 * J + 3];                            \
    }                                                   \
    break;
    DETLOGP_CASE(0) DETLOGP_CASE(1) DETLOGP_CASE(2) DETLOGP_CASE(3)
    DETLOGP_CASE(4) DETLOGP_CASE(5) DETLOGP_CASE(6) DETLOGP_CASE(7)
    DETLOGP_CASE(8) DETLOGP_CASE(9) DETLOGP_CASE(10) DETLOGP_CASE(11)
    DETLOGP_CASE(12) DETLOGP_CASE(13) DETLOGP_CASE(14) DETLOGP_CASE(15)
    DETLOGP_CASE(16) DETLOGP_CASE(17) DETLOGP_CASE(18) DETLOGP_CASE(19)
    DETLOGP_CASE(20) DETLOGP_CASE(21) DETLOGP_CASE(22) DETLOGP_CASE(23)
    DETLOGP_CASE(24) DETLOGP_CASE(25) DETLOGP_CASE(26) DETLOGP_CASE(27)
    DETLOGP_CASE(28) DETLOGP_CASE(29) DETLOGP_CASE(30) DETLOGP_CASE(31)
#undef DETLOGP_CASE
    default:
      v[0] = v[1] = v[2] = v[3] = 0.0f;
      break;
  }
  return k == 0 ? v[0] : (k == 1 ? v[1] : (k == 2 ? v[2] : v[3]));
}

struct RowState {
  float max;
  float sum;
  float sum_y;  // sum of exp(z - max) * y (kEntropy only)
};

// The warp's top-k lists (kTopK only): rows [row0, row0 + 16) of the block,
// entry i of row r at z[i * kBlockM + r] (lane i reads entry i: no bank
// conflicts), sorted best first and padded with empty entries (-inf, -1),
// which rank after every real value and never let padding columns in.
struct TopKLists {
  float* z;
  int32_t* id;
  int row0;
};

__device__ __forceinline__ void TopKReset(const TopKLists& l, int k, int lane) {
  for (int idx = lane; idx < 16 * k; idx += 32) {
    const int at = (idx / 16) * kBlockM + l.row0 + idx % 16;
    l.z[at] = -INFINITY;
    l.id[at] = -1;
  }
  __syncwarp();
}

// Inserts (z, id) into the list of block row `row`, the whole warp at once:
// lane i holds entry i, the candidate's place is the number of entries that
// rank before it (a prefix: the list is sorted), entries from there move
// down one and the last drops. Returns the list's worst z afterwards.
__device__ __forceinline__ float TopKWarpInsert(const TopKLists& l, int k,
                                                int lane, int row, float z,
                                                int32_t id) {
  const bool holds = lane < k;
  const int at = lane * kBlockM + row;
  const float entry_z = holds ? l.z[at] : -INFINITY;
  const int32_t entry_id = holds ? l.id[at] : -1;
  const int place = __popc(__ballot_sync(
      0xffffffffu, holds && RanksBefore(entry_z, entry_id, z, id)));
  const float above_z = __shfl_up_sync(0xffffffffu, entry_z, 1);
  const int32_t above_id = __shfl_up_sync(0xffffffffu, entry_id, 1);
  float now_z = entry_z;
  if (holds && lane >= place) {
    now_z = lane == place ? z : above_z;
    l.z[at] = now_z;
    l.id[at] = lane == place ? id : above_id;
  }
  __syncwarp();
  return __shfl_sync(0xffffffffu, now_z, k - 1);
}

// One fragment position whose values passed some lane's screen (pass0 for
// the lanes' first rows, pass1 for their second; column id_col + 2 * quad
// lane): every survivor goes into its row's list, and the row's quad
// tightens its screen to the list's new worst entry. Not inlined: a copy
// per position and tile width would overflow the instruction cache.
__device__ __noinline__ float2 TopKSite(TopKLists l, int k, float z0, float z1,
                                        unsigned pass0, unsigned pass1,
                                        int32_t id_col, float2 screen) {
  const int lane = threadIdx.x & 31;
  while (pass0 != 0) {  // warp-uniform
    const int src = __ffs(pass0) - 1;
    pass0 &= pass0 - 1;
    const float z = __shfl_sync(0xffffffffu, z0, src);
    const float worst = TopKWarpInsert(l, k, lane, l.row0 + (src >> 2), z,
                                       id_col + 2 * (src & 3));
    if ((lane >> 2) == (src >> 2)) screen.x = fmaxf(screen.x, worst);
  }
  while (pass1 != 0) {
    const int src = __ffs(pass1) - 1;
    pass1 &= pass1 - 1;
    const float z = __shfl_sync(0xffffffffu, z1, src);
    const float worst = TopKWarpInsert(l, k, lane, l.row0 + (src >> 2) + 8, z,
                                       id_col + 2 * (src & 3));
    if ((lane >> 2) == (src >> 2)) screen.y = fmaxf(screen.y, worst);
  }
  return screen;
}

// Screens a tile's values of the thread's two rows against each row's worst
// entry and a lower bound on the tile's own k-th best, and inserts the
// survivors. Exact: the screen only drops values that rank after the list's
// worst entry or that k others in the tile beat.
template <int kW>
__device__ __forceinline__ void TopKTile(const KernelParams& p, const float* acc,
                                         int lane, int v0, const float* inv_t,
                                         const TopKLists& lists) {
  const int k = p.top_k;
  float screen[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = lists.row0 + (lane >> 2) + 8 * h;
    const float worst_z = lists.z[(k - 1) * kBlockM + row];
    float lower = -INFINITY;
    if (kW / 8 >= k) {
      // Each of the quad's threads holds kW / 32 groups of 8 values per row:
      // kW / 8 disjoint groups whose maxima are all >= their least.
      float least = INFINITY;
#pragma unroll
      for (int g = 0; g < kW / 32; ++g) {
        float gm = -INFINITY;
#pragma unroll
        for (int j = 4 * g; j < 4 * g + 4; ++j) {
          gm = fmaxf(gm, fmaxf(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
        }
        least = fminf(least, gm);
      }
      least = fminf(least, __shfl_xor_sync(0xffffffffu, least, 1));
      least = fminf(least, __shfl_xor_sync(0xffffffffu, least, 2));
      lower = least * inv_t[h];
    }
    screen[h] = fmaxf(lower, worst_z);
  }
  const int id_base = p.id_offset + v0;
#pragma unroll
  for (int j = 0; j < kW / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float z0 = acc[4 * j + e] * inv_t[0];
      const float z1 = acc[4 * j + 2 + e] * inv_t[1];
      const unsigned pass0 = __ballot_sync(0xffffffffu, z0 >= screen[0]);
      const unsigned pass1 = __ballot_sync(0xffffffffu, z1 >= screen[1]);
      if ((pass0 | pass1) != 0) {  // warp-uniform
        const float2 tightened =
            TopKSite(lists, k, z0, z1, pass0, pass1, id_base + 8 * j + e,
                     make_float2(screen[0], screen[1]));
        screen[0] = tightened.x;
        screen[1] = tightened.y;
      }
    }
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

  // ---- epilogue: online softmax of z = (acc + bias) / T over the tile.
  // y = acc + bias; the tile max of z is fl(max(y) * (1/T)) because rounding
  // is monotone and 1/T > 0; exp(z - m) is evaluated as
  // ex2(y * (log2e / T) - m * log2e).
  constexpr float kLog2e = 1.4426950408889634f;
  const int quad = lane & 3;
  const int limit = valid < kW ? valid : kW;
  float mx0 = -INFINITY, mx1 = -INFINITY;
  if (limit == kW) {
#pragma unroll
    for (int j = 0; j < kW / 8; ++j) {
      float2 b = make_float2(0.0f, 0.0f);
      if (p.bias != nullptr) {
        b = __ldg(reinterpret_cast<const float2*>(p.bias + v0 + 8 * j +
                                                  2 * quad));
      }
      acc[4 * j + 0] += b.x;
      acc[4 * j + 1] += b.y;
      acc[4 * j + 2] += b.x;
      acc[4 * j + 3] += b.y;
      mx0 = fmaxf(mx0, fmaxf(acc[4 * j + 0], acc[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(acc[4 * j + 2], acc[4 * j + 3]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < kW / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * quad + e;
        const bool ok = col < limit;
        float b = 0.0f;
        if (p.bias != nullptr && ok) b = __ldg(p.bias + v0 + col);
        const float y0 = acc[4 * j + e] + b;
        const float y1 = acc[4 * j + 2 + e] + b;
        acc[4 * j + e] = ok ? y0 : -INFINITY;
        acc[4 * j + 2 + e] = ok ? y1 : -INFINITY;
        mx0 = fmaxf(mx0, acc[4 * j + e]);
        mx1 = fmaxf(mx1, acc[4 * j + 2 + e]);
      }
    }
  }
  // The target logit: only the one thread holding it does any work.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int tcol = rows.target[h] - v0;
    if (tcol >= 0 && tcol < limit && ((tcol >> 1) & 3) == quad) {
      const float y = SelectFragment<kW / 8>(acc, tcol >> 3, 2 * h + (tcol & 1));
      p.logprobs[rows.row[h]] = y * rows.inv_t[h];
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float m0 = fmaxf(state[0].max, mx0 * rows.inv_t[0]);
  const float m1 = fmaxf(state[1].max, mx1 * rows.inv_t[1]);
  const float c0 = -m0 * kLog2e;
  const float c1 = -m1 * kLog2e;
  const float k0 = rows.inv_t[0] * kLog2e;
  const float k1 = rows.inv_t[1] * kLog2e;
  // Columns past the vocabulary hold y = -inf and weigh exp = 0; their y
  // enters the entropy sum clamped to -FLT_MAX so that 0 * y stays 0.
  const float y_floor = limit == kW ? -INFINITY : -FLT_MAX;
  float s0 = 0.0f, s1 = 0.0f, t0 = 0.0f, t1 = 0.0f;
#pragma unroll
  for (int j = 0; j < kW / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float e0 = Ex2(fmaf(acc[4 * j + e], k0, c0));
      const float e1 = Ex2(fmaf(acc[4 * j + 2 + e], k1, c1));
      s0 += e0;
      s1 += e1;
      if constexpr (kEntropy) {
        t0 = fmaf(e0, fmaxf(acc[4 * j + e], y_floor), t0);
        t1 = fmaf(e1, fmaxf(acc[4 * j + 2 + e], y_floor), t1);
      }
    }
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  const float r0 = Ex2((state[0].max - m0) * kLog2e);
  const float r1 = Ex2((state[1].max - m1) * kLog2e);
  state[0].sum = state[0].sum * r0 + s0;
  state[1].sum = state[1].sum * r1 + s1;
  if constexpr (kEntropy) {
    t0 += __shfl_xor_sync(0xffffffffu, t0, 1);
    t1 += __shfl_xor_sync(0xffffffffu, t1, 1);
    t0 += __shfl_xor_sync(0xffffffffu, t0, 2);
    t1 += __shfl_xor_sync(0xffffffffu, t1, 2);
    state[0].sum_y = state[0].sum_y * r0 + t0;
    state[1].sum_y = state[1].sum_y * r1 + t1;
  }
  state[0].max = m0;
  state[1].max = m1;
  if constexpr (kTopK) TopKTile<kW>(p, acc, lane, v0, rows.inv_t, lists);
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
  uint64_t* full = reinterpret_cast<uint64_t*>(
      smem_b + kStages * kBTileBytes);
  uint64_t* empty = full + kStages;
  float* top_z = reinterpret_cast<float*>(empty + kStages);
  int32_t* top_id = reinterpret_cast<int32_t*>(top_z + kBlockM * kMaxTopK);

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
    const int begin = p.split_begin[split];
    const int end = p.split_begin[split + 1];
    const int slab = row_block * kBlockM + consumer * 64;
    const bool active = slab < p.rows;
    ConsumerRows rows;
    RowState state[2];
    // The warp's rows' top-k lists, emptied for this item.
    const TopKLists lists{top_z, top_id, consumer * 64 + warp * 16};
    if constexpr (kTopK) TopKReset(lists, p.top_k, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = slab + warp * 16 + (lane >> 2) + 8 * h;
      rows.row[h] = r;
      const bool in = r < p.rows;
      rows.inv_t[h] = in ? __frcp_rn(RowTemperature(p, r)) : 1.0f;
      rows.target[h] = in ? RowTarget(p, r) : -(1 << 30);
      state[h] = RowState{-INFINITY, 0.0f, 0.0f};
    }
    const int tiles = TileCount(end - begin);
    for (int t = 0, v0 = begin; t < tiles; ++t) {
      const int width = TileWidth(end - begin, t);
      const int valid = end - v0;
      switch (width / kChunkRows) {
        case 8:
          ConsumeTile<256, kEntropy, kTopK>(
              p, acc, smem_a, smem_b, full, empty, ring, active, consumer,
              lane, v0, valid, rows, state, lists);
          break;
        case 7:
          ConsumeTile<224, kEntropy, kTopK>(
              p, acc, smem_a, smem_b, full, empty, ring, active, consumer,
              lane, v0, valid, rows, state, lists);
          break;
        case 6:
          ConsumeTile<192, kEntropy, kTopK>(
              p, acc, smem_a, smem_b, full, empty, ring, active, consumer,
              lane, v0, valid, rows, state, lists);
          break;
        case 5:
          ConsumeTile<160, kEntropy, kTopK>(
              p, acc, smem_a, smem_b, full, empty, ring, active, consumer,
              lane, v0, valid, rows, state, lists);
          break;
        case 4:
          ConsumeTile<128, kEntropy, kTopK>(
              p, acc, smem_a, smem_b, full, empty, ring, active, consumer,
              lane, v0, valid, rows, state, lists);
          break;
        case 3:
          ConsumeTile<96, kEntropy, kTopK>(
              p, acc, smem_a, smem_b, full, empty, ring, active, consumer,
              lane, v0, valid, rows, state, lists);
          break;
        case 2:
          ConsumeTile<64, kEntropy, kTopK>(
              p, acc, smem_a, smem_b, full, empty, ring, active, consumer,
              lane, v0, valid, rows, state, lists);
          break;
        case 1:
          ConsumeTile<32, kEntropy, kTopK>(
              p, acc, smem_a, smem_b, full, empty, ring, active, consumer,
              lane, v0, valid, rows, state, lists);
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
          // The split's partial {max, sum_exp} is stored as its logsumexp
          // (the equivalent partial {lse_s, 1}): 4 bytes instead of 8.
          const int64_t cell =
              static_cast<int64_t>(rows.row[h]) * p.num_splits + split;
          p.split_lse[cell] = state[h].max + logf(state[h].sum);
          if constexpr (kEntropy) {
            p.split_mean_z[cell] =
                (state[h].sum_y / state[h].sum) * rows.inv_t[h];
          }
        }
      }
    }
    if constexpr (kTopK) {
      // Each list, sorted, empty entries (id -1) last.
      const int64_t first_row = static_cast<int64_t>(row_block) * kBlockM;
      for (int idx = lane; idx < 16 * p.top_k; idx += 32) {
        const int r = lists.row0 + idx % 16;
        const int i = idx / 16;
        if (!active || first_row + r >= p.rows) continue;
        const int64_t out =
            ((first_row + r) * p.num_splits + split) * p.top_k + i;
        p.split_top_z[out] = lists.z[i * kBlockM + r];
        p.split_top_id[out] = lists.id[i * kBlockM + r];
      }
      __syncwarp();
    }
  }
}

}  // namespace detlogp::kernels::cuda::v3

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_KERNEL_CUH_
