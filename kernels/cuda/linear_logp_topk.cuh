// Top-k selection for the linear-logp split kernels (both: the Hopper
// kernel and the portable one, through linear_logp_epilogue.cuh): each
// (row, split) keeps the k best (z, id) of its columns in a shared-memory
// list, candidates screened by bounds that the row's splits share through
// the workspace, survivors inserted by the whole warp; the combine merges
// the lists (linear_logp_combine_kernel.cuh). Every list holds the same
// set whatever order its candidates arrive in (RanksBefore is a total
// order), and no screen drops a value of the row's top-k, so the combined
// top-k depends on the row alone.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_TOPK_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_TOPK_CUH_

#include <cfloat>
#include <cstdint>

#include "kernels/softmax_partial.h"
#include "kernels/top_k_screen_key.h"

namespace detlogp::kernels::cuda::epilogue {

// What the top-k code reads besides the tile and the lists.
struct TopKParams {
  uint32_t* top_screen;  // [rows][kScreenWords], zeroed, or null: no sharing
  int32_t top_k;         // 1..kMaxTopK
  int32_t id_offset;     // added to top-k ids (a shard's first row)
  int32_t rows;
};

// The warp's top-k lists (kTopK only): rows [row0, row0 + 16) of the block,
// sorted best first and padded with empty entries (-inf, -1), which rank
// after every real value and never let padding columns in. Entry i of row r
// is at TopKSlot(i, r): rows are xor-swizzled by the entry's low five bits,
// so both ways the lists are read hit 32 different banks: one row's entries
// (the warp-wide insert, lane i reading entry i; unswizzled, all of them
// shared a bank) and one entry of 32 consecutive rows.
struct TopKLists {
  // Shared-window addresses: the insert runs in a function that is not
  // inlined, where generic pointers became generic loads and stores.
  uint32_t z;
  uint32_t id;
  int row0;
  int stride;  // rows in the block's lists, a multiple of 32

  __device__ __forceinline__ int TopKSlot(int i, int r) const {
    return i * stride + (r ^ (i & 31));
  }
  __device__ __forceinline__ float Z(int slot) const {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];"
                 : "=f"(v)
                 : "r"(z + 4 * slot)
                 : "memory");
    return v;
  }
  __device__ __forceinline__ int32_t Id(int slot) const {
    int32_t v;
    asm volatile("ld.shared.s32 %0, [%1];"
                 : "=r"(v)
                 : "r"(id + 4 * slot)
                 : "memory");
    return v;
  }
  __device__ __forceinline__ void Set(int slot, float zv, int32_t idv) const {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(z + 4 * slot), "f"(zv)
                 : "memory");
    asm volatile("st.shared.s32 [%0], %1;" ::"r"(id + 4 * slot), "r"(idv)
                 : "memory");
  }
};

// The lists of a block's rows at shared memory z and id (stride: rows).
__device__ __forceinline__ TopKLists MakeTopKLists(float* z, int32_t* id,
                                                   int row0, int stride) {
  return TopKLists{static_cast<uint32_t>(__cvta_generic_to_shared(z)),
                   static_cast<uint32_t>(__cvta_generic_to_shared(id)), row0,
                   stride};
}

// Shared memory for a block's lists of up to max_k (z, id) entries per row.
__host__ __device__ constexpr int TopKListBytes(int block_rows, int max_k) {
  return block_rows * max_k * 8;
}

// What a row's splits share to screen top-k candidates (kTopK, when
// top_screen is set): values proven to be at most the row's k-th best, as
// order-preserving uint32 keys (kernels/top_k_screen_key.h) raised with
// atomicMax. Values below them cannot be in the row's top-k, so a split may
// drop them. Which values a split drops then depends on timing, but not the
// result: every value of the row's top-k is at least every bound ever
// published, so it reaches its split's list, and the combine takes the k
// best of all lists. Per row,
// kScreenWords keys (zeroed by the launch: 0 is below every float):
//   * kScreenSlots slots, each the largest z seen in a fixed set of
//     columns (slot ScreenSlot(v0, quad), kernels/top_k_screen_key.h,
//     gathers one thread's columns of one tile; different slots, disjoint
//     columns). The k-th largest slot is then at most the row's k-th best
//     value: k distinct columns reach it. Read (SlotBound) by a tile that
//     has candidates left.
//   * the screen word: raised to a split's full list's worst entry, or a
//     tile's k-th-best lower bound; read at every tile. Launch on the
//     Hopper kernel starts it at a speculative floor instead of -inf
//     (linear_logp_floor_kernel.cuh): a guess, not a proof. A row it
//     overshoots comes out short in the combine and is computed again
//     with a cleared screen, so the result above still holds.
inline constexpr int kScreenWord = kScreenSlots;       // after the slots
inline constexpr int kScreenWords = kScreenSlots + 4;  // 16-byte rows

__device__ __forceinline__ uint32_t* RowScreenWords(const TopKParams& p,
                                                    int row) {
  return p.top_screen + static_cast<int64_t>(row) * kScreenWords;
}

// The row's screen word as its key (read through L2, where the atomics
// land), or 0 (-inf). A kernel that loads it ahead of the fold keeps the key
// and converts it there: converted at the load, the L2 round trip stalled
// the warp before its K loop.
__device__ __forceinline__ uint32_t LoadRowScreenKey(const TopKParams& p,
                                                     int row) {
  if (p.top_screen == nullptr || row >= p.rows) return 0;
  return __ldcg(RowScreenWords(p, row) + kScreenWord);
}

// The row's screen word, or -inf.
__device__ __forceinline__ float LoadRowScreen(const TopKParams& p, int row) {
  return ScreenValue(LoadRowScreenKey(p, row));
}

// The least, over a row's quad, of each thread's r-th best value, from its
// kN keys sorted best first (SortKeysDescending), 1 <= r <= kN. keys[r - 1]
// as a chain of selects: an index would put the array in local memory.
template <int kN>
__device__ __forceinline__ float QuadLeastOfRthKey(const uint32_t* keys,
                                                   int r) {
  uint32_t rth = keys[0];
#pragma unroll
  for (int i = 1; i < kN; ++i) {
    if (i < r) rth = keys[i];
  }
  const float least = ScreenValue(rth);
  const float pair = fminf(least, __shfl_xor_sync(0xffffffffu, least, 1));
  return fminf(pair, __shfl_xor_sync(0xffffffffu, pair, 2));
}

// The k-th largest of the quad's values (`best`: kN per thread, sorted best
// first; consumed), or -inf when they hold fewer than k real ones, k <= 4 kN:
// a merge that pops the quad's largest head k times, the lowest lane on a
// tie, so that k pops take k distinct values.
template <int kN>
__device__ __forceinline__ float QuadKthOfSorted(float* best, int k, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  float kth = -INFINITY;
  for (int i = 0; i < k; ++i) {  // warp-uniform
    float m = fmaxf(best[0], __shfl_xor_sync(kAll, best[0], 1));
    m = fmaxf(m, __shfl_xor_sync(kAll, m, 2));
    const unsigned holders =
        (__ballot_sync(kAll, best[0] == m) >> (lane & ~3)) & 0xfu;
    if ((lane & 3) == __ffs(holders) - 1) {
#pragma unroll
      for (int j = 0; j + 1 < kN; ++j) best[j] = best[j + 1];
      best[kN - 1] = -INFINITY;
    }
    kth = m;
  }
  return kth;
}

// How SlotBound turns the quad's slots into a bound. Each thread reads 16
// slots and sorts them (SortKeysDescending, on the keys); then
//   * kQuadLeast: the least of the four threads' r-th largest, r =
//     ceil(k / 4) (the four have 4r >= k slots at or above it). Cheap, but
//     -inf until every thread's 16 slots hold r values, as in a row's first
//     tiles, when few slots are set.
//   * kMerged: the k-th largest of the quad's 32 best, 8 per thread
//     (QuadKthOfSorted): exact over the slots unless one thread holds more
//     than 8 of their k best, and a bound either way (k distinct slots
//     reach it); ~k merge steps.
// Chosen per kernel by measurement (docs/kernels.md, "Top-k screens"): the
// merge pays in the portable kernel; in the Hopper kernel, whose epilogue
// holds up the tensor cores, the cheap one is as fast or faster.
enum class SlotBoundKind { kQuadLeast, kMerged };

// A lower bound on the row's k-th best from its slots, or -inf; quad
// collective (the row's four threads, all lanes of the warp present).
template <SlotBoundKind kKind>
__device__ __forceinline__ float SlotBound(const TopKParams& p, int row,
                                           int lane) {
  constexpr int kPerThread = kScreenSlots / 4;
  constexpr int kKept = 8;    // x 4 threads: 32, the largest k
  uint32_t keys[kPerThread];  // 0: -inf
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) keys[i] = 0;
  if (p.top_screen != nullptr && row < p.rows) {
    const uint4* slots = reinterpret_cast<const uint4*>(
        RowScreenWords(p, row) + (lane & 3) * kPerThread);
#pragma unroll
    for (int q = 0; q < kPerThread / 4; ++q) {
      const uint4 four = __ldcg(slots + q);
      keys[4 * q + 0] = four.x;
      keys[4 * q + 1] = four.y;
      keys[4 * q + 2] = four.z;
      keys[4 * q + 3] = four.w;
    }
  }
  SortKeysDescending<kPerThread>(keys);
  if constexpr (kKind == SlotBoundKind::kMerged) {
    float best[kKept];
#pragma unroll
    for (int i = 0; i < kKept; ++i) best[i] = ScreenValue(keys[i]);
    return QuadKthOfSorted<kKept>(best, p.top_k, lane);
  } else {
    return QuadLeastOfRthKey<kKept>(keys, (p.top_k + 3) / 4);  // r <= 8
  }
}

__device__ __forceinline__ void TopKReset(const TopKLists& l, int k, int lane) {
  for (int idx = lane; idx < 16 * k; idx += 32) {
    const int at = l.TopKSlot(idx / 16, l.row0 + idx % 16);
    l.Set(at, -INFINITY, -1);
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
  const int at = l.TopKSlot(lane, row);
  const float entry_z = holds ? l.Z(at) : -INFINITY;
  const int32_t entry_id = holds ? l.Id(at) : -1;
  const int place = __popc(__ballot_sync(
      0xffffffffu, holds && RanksBefore(entry_z, entry_id, z, id)));
  const float above_z = __shfl_up_sync(0xffffffffu, entry_z, 1);
  const int32_t above_id = __shfl_up_sync(0xffffffffu, entry_id, 1);
  float now_z = entry_z;
  if (holds && lane >= place) {
    now_z = lane == place ? z : above_z;
    l.Set(at, now_z, lane == place ? id : above_id);
  }
  __syncwarp();
  return __shfl_sync(0xffffffffu, now_z, k - 1);
}

// One fragment position whose values passed some lane's screen (pass0 for
// the lanes' first rows, pass1 for their second; column id_col + 2 * quad
// lane): every survivor goes into its row's list, and the row's quad
// tightens its screen to the list's new worst entry. Not inlined: a copy
// per position and tile width would overflow the instruction cache.
static __device__ __noinline__ float2 TopKSite(TopKLists l, int k, float z0,
                                               float z1, unsigned pass0,
                                               unsigned pass1, int32_t id_col,
                                               float2 screen) {
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

// One group's 8 positions (columns id_col + 8 jj + e + 2 * quad, jj < 4,
// e < 2; row 0's values r0a = jj 0-1, r0b = jj 2-3, as (e 0, e 1) pairs,
// row 1's r1a, r1b), screened and inserted position by position, the
// screen tightening as insertions land. Not inlined: one copy serves every
// group of every tile width.
static __device__ __noinline__ float2 TopKGroup(TopKLists l, int k, float4 r0a,
                                                float4 r0b, float4 r1a,
                                                float4 r1b, float2 inv_t,
                                                int32_t id_col, float2 screen) {
  constexpr unsigned kAll = 0xffffffffu;
  const float y0[8] = {r0a.x, r0a.y, r0a.z, r0a.w, r0b.x, r0b.y, r0b.z, r0b.w};
  const float y1[8] = {r1a.x, r1a.y, r1a.z, r1a.w, r1b.x, r1b.y, r1b.z, r1b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // i = 2 jj + e
    const float z0 = y0[i] * inv_t.x;
    const float z1 = y1[i] * inv_t.y;
    const unsigned pass0 = __ballot_sync(kAll, z0 >= screen.x);
    const unsigned pass1 = __ballot_sync(kAll, z1 >= screen.y);
    if ((pass0 | pass1) != 0) {  // warp-uniform
      screen = TopKSite(l, k, z0, z1, pass0, pass1,
                        id_col + 8 * (i / 2) + (i % 2), screen);
    }
  }
  return screen;
}

// A tile's values in groups: group g of a thread's row h is its 8 values in
// columns [32 g, 32 g + 32) of the tile (fragments 4 g .. 4 g + 3), so a
// tile of kW columns has kW / 32 groups per thread-row.
template <int kW>
inline constexpr int kTileGroups = kW / 32;

// The thread's largest y in group g of row h.
__device__ __forceinline__ float GroupMax(const float* acc, int h, int g) {
  float gm = -INFINITY;
#pragma unroll
  for (int j = 4 * g; j < 4 * g + 4; ++j) {
    gm = fmaxf(gm, fmaxf(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
  }
  return gm;
}

// The thread's group maxima of a tile (TopKTile's screens). A fold that
// takes them in its maxima pass (TileMaxes<kW, true>) passes them in;
// otherwise TopKTile works them out from the accumulators where it needs
// them, which costs the pass again for every warp that has candidates.
template <int kW>
struct GroupMaxima {
  float v[2][kTileGroups<kW> > 0 ? kTileGroups<kW> : 1];  // [row h][group]
};

template <int kW, bool kGiven>
__device__ __forceinline__ float GroupMaxOf(const GroupMaxima<kW>& given,
                                            const float* acc, int h, int g) {
  if constexpr (kGiven) {
    return given.v[h][g];
  } else {
    return GroupMax(acc, h, g);
  }
}

// A lower bound on the k-th best of a tile's values in the thread's row h
// (y, before 1 / T), or -inf: each of the row's quad threads takes its r-th
// best, r = ceil(k / 4), of the two largest values of each of its groups
// (a subset's r-th best is at most the thread's r-th best value); the least
// of the quad's four is then at most 4r >= k distinct values of the tile.
// ~350 instructions per row, on the busy path only, where the rows have
// little else to screen with (a split's first tiles: with the r-th best of
// the group maxima alone, the bound sat near the tile's median and each
// fresh list took ~k insertions more per row).
template <int kW>
__device__ __forceinline__ float TileKthLowerBound(const float* acc, int h,
                                                   int k) {
  constexpr int kGroups = kTileGroups<kW>;
  static_assert(kGroups <= 8, "16 keys");
  const int r = (k + 3) / 4;
  if (kGroups == 0 || r > 2 * kGroups) return -INFINITY;
  uint32_t keys[16];
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    float m1 = -INFINITY, m2 = -INFINITY;
    if (g < kGroups) {
#pragma unroll
      for (int j = 4 * g; j < 4 * g + 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = acc[4 * j + 2 * h + e];
          m2 = fmaxf(m2, fminf(m1, v));
          m1 = fmaxf(m1, v);
        }
      }
    }
    keys[2 * g] = g < kGroups ? ScreenKey(m1) : 0u;
    keys[2 * g + 1] = g < kGroups ? ScreenKey(m2) : 0u;
  }
  SortKeysDescending<16>(keys);
  return QuadLeastOfRthKey<8>(keys, r);  // r <= 8 as k <= 32
}

// Screens a tile's values of the thread's two rows and inserts the
// survivors into the rows' lists. Exact: a value is dropped only when k
// others of its row beat it. The thread first publishes its tile maximum
// (`mx`, y before 1 / T) into its slot; then a row's screen, cheapest first:
//   * its list's worst entry, the row's screen word (`shared`, loaded when
//     the tile's fold began) and the split's screen after its last tile
//     (`carried`, updated here): a thread whose tile maximum is below them
//     has nothing to offer, and a warp with no such thread is done;
//   * when many thread-rows of the warp still have candidates: the tile's
//     own k-th-best lower bound, published with an atomicMax whose answer
//     brings back the word as the row's other splits left it, and the
//     slots' bound (SlotBound), which by then holds the maxima of this tile
//     and, likely, of the row's splits running beside this one (they all
//     start with empty lists: this is where they cut each other's
//     insertions);
//   * each insertion's new worst entry, published when the tile is done.
//
// kGiven: `given` holds the tile's group maxima (else they are worked out
// from acc where needed).
template <int kW, SlotBoundKind kSlotBound, bool kGiven>
__device__ __forceinline__ void TopKTile(const TopKParams& p, const float* acc,
                                         const GroupMaxima<kW>& given, int lane,
                                         int v0, const int* row,
                                         const float* inv_t, const float* mx,
                                         const float* shared, float* carried,
                                         const TopKLists& lists) {
  constexpr unsigned kAll = 0xffffffffu;
  const int k = p.top_k;
  float screen[2], top[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int list_row = lists.row0 + (lane >> 2) + 8 * h;
    const float worst = lists.Z(lists.TopKSlot(k - 1, list_row));
    screen[h] = fmaxf(fmaxf(worst, shared[h]), carried[h]);
    top[h] = mx[h] * inv_t[h];  // the thread's best z of the row's tile
  }
  const bool sharing = p.top_screen != nullptr;
  if (sharing) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] < p.rows && top[h] > shared[h]) {  // below: no use
        atomicMax(RowScreenWords(p, row[h]) + ScreenSlot(v0, lane & 3),
                  ScreenKey(top[h]));
      }
    }
  }
  if (!__any_sync(kAll, top[0] >= screen[0] || top[1] >= screen[1])) {
    carried[0] = screen[0];
    carried[1] = screen[1];
    return;
  }

  // Bounds cost a round trip to L2 and a few hundred instructions: worth it
  // only when many of the warp's thread-rows still have candidates (early
  // in a row's splits), not for the odd one.
  constexpr int kFewCandidates = 8;
  const int busy = __popc(__ballot_sync(kAll, top[0] >= screen[0])) +
                   __popc(__ballot_sync(kAll, top[1] >= screen[1]));
  float published[2] = {shared[0], shared[1]};
#pragma unroll
  for (int h = 0; h < 2 && busy > kFewCandidates; ++h) {
    const float bound = TileKthLowerBound<kW>(acc, h, k) * inv_t[h];
    float row_screen = shared[h];
    if (sharing && (lane & 3) == 0 && row[h] < p.rows && bound > shared[h]) {
      const uint32_t before =
          atomicMax(RowScreenWords(p, row[h]) + kScreenWord, ScreenKey(bound));
      row_screen = fmaxf(ScreenValue(before), bound);
    }
    // The slots now hold this tile's maxima and, likely, those of the
    // row's other splits running beside this one.
    const float slots = SlotBound<kSlotBound>(p, row[h], lane);
    published[h] = __shfl_sync(kAll, row_screen, lane & ~3);
    screen[h] = fmaxf(fmaxf(screen[h], bound), fmaxf(published[h], slots));
  }
  if (!__any_sync(kAll, top[0] >= screen[0] || top[1] >= screen[1])) {
    carried[0] = screen[0];
    carried[1] = screen[1];
    return;
  }

  // Group by group (8 values per thread-row) that a group whose maximum
  // is below the screen skips with one vote; a group with candidates goes
  // to TopKGroup, one copy of the position code for every group and tile
  // width (unrolled here, it was ~8x the code, and instruction-cache misses
  // cost ~2 % of the kernel under ncu).
  const int id_base = p.id_offset + v0;
#pragma unroll
  for (int g = 0; g < kTileGroups<kW>; ++g) {
    const float gm0 = GroupMaxOf<kW, kGiven>(given, acc, 0, g);
    const float gm1 = GroupMaxOf<kW, kGiven>(given, acc, 1, g);
    if (!__any_sync(
            kAll, gm0 * inv_t[0] >= screen[0] || gm1 * inv_t[1] >= screen[1])) {
      continue;  // warp-uniform
    }
    const float* y = acc + 16 * g;
    const float2 tightened =
        TopKGroup(lists, k, make_float4(y[0], y[1], y[4], y[5]),
                  make_float4(y[8], y[9], y[12], y[13]),
                  make_float4(y[2], y[3], y[6], y[7]),
                  make_float4(y[10], y[11], y[14], y[15]),
                  make_float2(inv_t[0], inv_t[1]), id_base + 32 * g,
                  make_float2(screen[0], screen[1]));
    screen[0] = tightened.x;
    screen[1] = tightened.y;
  }
  carried[0] = screen[0];
  carried[1] = screen[1];
  if (sharing && (lane & 3) == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] < p.rows && screen[h] > published[h]) {
        atomicMax(RowScreenWords(p, row[h]) + kScreenWord,
                  ScreenKey(screen[h]));
      }
    }
  }
}

// Writes the warp's 16 lists (rows lists.row0 ..) for rows below `rows` of
// the block starting at first_row: sorted, empty entries (id -1) last. A row
// at a time, lane i its entry i: a row's k entries are consecutive in the
// workspace, so each store is one coalesced run (by entry across rows, each
// lane's store hit a different row's cell, and the 64-bit index math was
// most of the cost).
__device__ __forceinline__ void StoreTopKLists(const TopKLists& lists, int k,
                                               int lane, int64_t first_row,
                                               int rows, int num_splits,
                                               int split, float* split_top_z,
                                               int32_t* split_top_id) {
  const int64_t row_stride = static_cast<int64_t>(num_splits) * k;
  int64_t out = ((first_row + lists.row0) * num_splits + split) * k + lane;
#pragma unroll
  for (int r = 0; r < 16; ++r, out += row_stride) {
    const int list_row = lists.row0 + r;
    if (lane < k && first_row + list_row < rows) {
      const int at = lists.TopKSlot(lane, list_row);
      split_top_z[out] = lists.Z(at);
      split_top_id[out] = lists.Id(at);
    }
  }
  __syncwarp();
}

}  // namespace detlogp::kernels::cuda::epilogue

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_TOPK_CUH_
