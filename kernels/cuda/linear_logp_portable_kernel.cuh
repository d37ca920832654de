// Kernel version portable-mma-sync-v1: batch-invariant fused linear + online
// softmax split pass on mma.sync. Uses only instructions every
// NVIDIA GPU from sm_80 on has: mma.sync.aligned.m16n8k16 (bf16 in, fp32
// accumulate), ldmatrix and cp.async. Self-contained (no Hopper PTX), so the
// same source builds for sm_80, sm_86, sm_89, sm_90 and compute_80 PTX.
// Included by linear_logp_portable.cu alone: the kernel's one translation
// unit, built for sm_80, sm_86, sm_89 and sm_90 machine code and compute_80
// PTX (kernels/cuda/BUILD); the launcher reaches it through
// linear_logp_portable.h. Tested bitwise on the H200 (forced there):
// tests/cuda/linear_logp_portable_test.cu.
//
// Contract (the same as v3, linear_logp_kernel.cuh):
//   * A work item is (row block of kBlockM rows, vocabulary split s),
//     one CTA per item (grid = row blocks x splits). Splits come from the
//     host's table (split_begin), in the batch-invariant mode
//     kernels/split_policy.h's VocabSplitRange(V, s), a function of V alone.
//   * A split [begin, end) is walked in ascending vocabulary order in
//     ceil((end - begin) / 128) tiles of 128 columns starting at begin; the
//     last tile's columns past `end` are masked to -inf (they may hold the
//     next split's rows or padding, which never count). The tiling depends
//     on the split boundaries alone, never on N or on the row position.
//   * Each logit is one mma.sync accumulation chain over k = 0, 16, ...,
//     H - 16 (a fixed K order; mma.sync computes every output element from
//     its own row and column only).
//   * A warp owns 16 * kWarpMFrags rows of the block (one or two m16
//     fragments) across the tile's 128 columns, or a 128 / kColumnParts
//     part of them (8 fp32 accumulators per n8 fragment, m16 fragment and
//     thread). A thread holds two rows per
//     fragment (lane / 4 and lane / 4 + 8), like a v3 consumer, and each
//     fragment's rows go through v3's epilogue with W = 128
//     (linear_logp_epilogue.cuh, shared with the Hopper kernel): per-thread
//     fold in fixed column order, then a fixed xor-shuffle over the 4 lanes
//     of the row's quad, then the per-row online state (max, sum exp(z - max))
//     in ascending tile order. No atomics. A row's arithmetic is the same
//     whichever tiling, warp or fragment holds it. In the narrow tilings four
//     or eight warps share a tile's columns: the row maxima meet in shared
//     memory (max is exact in any order) and each thread's running sums pass
//     from part to part in column order, so the additions are the same, in
//     the same order, as one warp holding the whole tile (FoldTileChained).
//   * The split's state is written once per (row, split) as its logsumexp to
//     split_lse[row][split] (v3's partial format), folded by the shared
//     combine kernel (linear_logp_combine_kernel.cuh, compiled in the same
//     translation unit for the same architectures) in ascending split order.
//   * z = y * inv_t with y = acc + bias and inv_t = __frcp_rn(T), as in v3;
//     the thread that holds z[target] writes it to logprobs[row].
//   * Rows >= N and weight rows >= the padded vocabulary are zero-filled by
//     cp.async (never read out of bounds); warps whose rows are all >= N
//     skip their mma and never write.
//   * Pipeline: a kStages-deep cp.async ring of (A: kBlockM x kBlockK, B:
//     128 kTilesPerStep x kBlockK) bf16 tiles, one __syncthreads per K step;
//     the (tile group, k-block) steps of an item form one stream, so the
//     ring runs across tiles; a step's tiles are folded one after the other
//     in column order once their last k-block is in. The next step's copies
//     go out in pieces between the k16 mma, their addresses walked by
//     additions (CopyCursor). Shared rows of 128 bytes, 16-byte chunks
//     XOR-swizzled by row % 8 so that ldmatrix and cp.async hit distinct
//     banks.
//   * Tilings (Tiling below; EnqueueSplitKernel picks one by N, extras and
//     the GPU's shared memory): wide (N > 128), 128 rows as 4 warps x 32
//     rows, 3 stages (96 KiB), two CTAs per SM where the shared memory
//     allows; from N > 256 where a block may have 208 KiB, 256 rows as 8
//     warps of 64 rows x 64 columns (two warps chain a tile's fold), 4
//     stages, the rows' states in shared memory; narrow (N <= 16, 32, 64,
//     128), warps splitting each tile's columns and K steps of up to three
//     tiles, because a small batch's 132 CTAs are one per SM and one warp
//     per 128 columns cannot hide the mma and ldmatrix latencies; top-k,
//     128 rows, 2 stages and the lists (96 KiB), or for N <= 64 64 rows as
//     4 warps with 4 stages. CTAs run their items in kernels/item_order.h's
//     order (KernelParams::row_group).
//     Tilings, rings and occupancy are schedule only: every logit is the
//     same mma chain and every fold the same order, so they keep the
//     version's bits (a row alone, in a narrow tiling, equals the row in a
//     large batch: tests/cuda/linear_logp_portable_test.cu).
//   * Entropy and top-k are v3's (linear_logp_kernel.cuh; the same epilogue
//     code): a mean-z partial per (row, split), and per (row, split) a
//     sorted list of the k best (z, id) in shared memory, screened and
//     inserted warp-wide, written to the workspace for the combine. Asking
//     for them never changes logprob or lse bits.
// Build flags matter for bits: -O3, no --use_fast_math / -ftz / -prec-div
// changes. Any change to the arithmetic or the vocabulary tiling must bump
// kVersion.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_KERNEL_CUH_

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/linear_logp_epilogue.cuh"
#include "kernels/cuda/linear_logp_portable_params.cuh"
#include "kernels/cuda/mma_sync.cuh"
#include "kernels/item_order.h"

namespace detlogp::kernels::cuda::portable_v1 {

using epilogue::RowState;
using epilogue::TopKLists;
using kernels::DecodeItem;
using kernels::RowBlockAndSplit;

// A CTA's shape and schedule. None of it enters a row's arithmetic.
template <int kBlockM_, int kWarpMFrags_, int kColumnParts_, int kTilesPerStep_,
          int kStages_, int kMinBlocksPerSm_, bool kListsInSmem_,
          bool kRowsInSmem_ = false>
struct Tiling {
  static constexpr int kBlockM = kBlockM_;          // rows per item
  static constexpr int kWarpMFrags = kWarpMFrags_;  // m16 fragments per warp
  // Warps sharing a row group's 128 columns, kPartCols each; their folds
  // chain through shared memory (FoldTileChained).
  static constexpr int kColumnParts = kColumnParts_;
  // 128-column tiles a K step carries (their mma interleave; they are folded
  // one after the other, in column order).
  static constexpr int kTilesPerStep = kTilesPerStep_;
  static constexpr int kStepCols = kBlockN * kTilesPerStep;
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kWarpRows = 16 * kWarpMFrags;
  static constexpr int kRowGroups = kBlockM / kWarpRows;
  static constexpr int kWarps = kRowGroups * kColumnParts;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kPartCols = kBlockN / kColumnParts;
  static constexpr int kATileBytes = kBlockM * kRowBytes;
  static constexpr int kStageBytes = kATileBytes + kStepCols * kRowBytes;
  static constexpr int kRingBytes = kStages * kStageBytes;
  // After the ring: top-k lists (kBlockM rows x kMaxTopK (z, id)), then the
  // chained fold's exchange: each part's row maxima and each lane's running
  // (s, t) for its two rows.
  static constexpr int kListBytes =
      kListsInSmem_ ? epilogue::TopKListBytes(kBlockM, kMaxTopK) : 0;
  static constexpr int kXchgMaxFloats = kColumnParts * kWarpRows;
  static constexpr int kXchgSumFloats = kWarpMFrags * 4 * 32;
  static constexpr int kXchgBytes =
      kColumnParts > 1 ? kRowGroups*(kXchgMaxFloats + kXchgSumFloats) * 4 : 0;
  // kRowsInSmem: each row's fold inputs (1 / T, target) and online state
  // wait in shared memory between folds, so that the main loop's registers
  // hold the accumulators (a warp of 64 x 64 holds 8 rows per thread).
  static constexpr bool kRowsInSmem = kRowsInSmem_;
  static constexpr int kRowsOffset = kRingBytes + kListBytes + kXchgBytes;
  static constexpr int kRowsBytes =
      kRowsInSmem ? kBlockM * static_cast<int>(sizeof(RowState) + 8) : 0;
  static constexpr int kSmemBytes = kRowsOffset + kRowsBytes;
  static_assert(kRowsOffset % 16 == 0, "RowState alignment");
  static_assert(kBlockM % kWarpRows == 0, "whole warps");
  static_assert(kColumnParts == 1 || !kListsInSmem_,
                "chained folds have no top-k");
  static_assert(kBlockM % 32 == 0 || !kListsInSmem_, "TopKSlot's swizzle");
  static_assert(kRowGroups <= 15, "a named barrier per row group");
  static_assert((kBlockM * kChunksPerRow) % kThreads == 0, "A copy split");
  static_assert((kStepCols * kChunksPerRow) % kThreads == 0, "B copy split");
};

// N = 129-256, N > 256 without Wide256Tiling's shared memory, and N <= 128
// without Narrow128Tiling's: 4 warps of 32 rows; two CTAs per SM where
// shared memory allows.
using WideTiling = Tiling<128, 2, 1, 1, 3, 2, false>;
// N > 256 where the GPU has the shared memory (208 KiB: H100/H200): 256
// rows as 4 row groups of 64 x 2 column parts of 64 (8 warps of 64 x 64:
// a fifth fewer ldmatrix per mma than 32 x 128, and half the weight copies
// per row of WideTiling's 128-row blocks), 4 stages, one CTA per SM, the
// rows' state in shared memory (8 rows per thread would spill). 3-8 % over
// WideTiling at N = 2048-8192 on the H200.
using Wide256Tiling = Tiling<256, 4, 2, 1, 4, 1, false, true>;
// N <= 64: the weight stream is the cost, and one CTA per split means one
// per SM, so the warps of a row group split the tile's columns between them
// (measured on the H200): N <= 16, 16 rows x 4 parts of 32
// columns (4 warps), an 8-stage ring; N <= 32, 32 rows x 8 parts of 16
// (8 warps), 4 stages; N <= 64, 2 row groups of 32 x 4 parts of 32 (8
// warps; fewer shared-memory reads per mma than 16 warps), 4 stages (227
// KiB: all of an H100/H200 SM's opt-in shared memory). Both carry three
// tiles per K step (three times the independent mma chains per warp).
using Narrow16Tiling = Tiling<16, 1, 4, 1, 8, 1, false>;
using Narrow32Tiling = Tiling<32, 2, 8, 3, 4, 1, false>;
using Narrow64Tiling = Tiling<64, 2, 4, 3, 4, 1, false>;
// N <= 128: one row block of 128 (132 CTAs, one per SM) as 4 row groups of
// 32 x 2 parts of 64 columns (8 warps), K steps of two tiles, 3 stages (149
// KiB); without that shared memory, the wide tiling.
using Narrow128Tiling = Tiling<128, 2, 2, 2, 3, 1, false>;
// The same on GPUs without their shared memory (sm_86, sm_89).
using Narrow16ShallowTiling = Tiling<16, 1, 4, 1, 5, 1, false>;
using Narrow32ShallowTiling = Tiling<32, 2, 8, 2, 2, 1, false>;
using Narrow64ShallowTiling = Tiling<64, 2, 4, 1, 3, 1, false>;
// N > 64 with top-k: the lists take the third stage's room.
using TopKTiling = Tiling<128, 2, 1, 1, 2, 2, true>;
// N <= 64 with top-k: 64 rows as 4 warps x 16 rows (top-k lists need a
// row's whole tile in one warp), 4 stages (112 KiB); 3 without them.
using TopKNarrowTiling = Tiling<64, 1, 1, 1, 4, 1, true>;
using TopKNarrowShallowTiling = Tiling<64, 1, 1, 1, 3, 1, true>;
static_assert(WideTiling::kSmemBytes <= kMinSmemBytes, "fits every sm_80+");
static_assert(Narrow16ShallowTiling::kSmemBytes <= kMinSmemBytes, "fits");
static_assert(Narrow32ShallowTiling::kSmemBytes <= kMinSmemBytes, "fits");
static_assert(Narrow64ShallowTiling::kSmemBytes <= kMinSmemBytes, "fits");
static_assert(TopKTiling::kSmemBytes <= kMinSmemBytes, "fits too");
static_assert(TopKNarrowShallowTiling::kSmemBytes <= kMinSmemBytes, "fits");

// ------------------------------------------------------------------ PTX
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, zero-filled when !valid (src is then not read).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src,
                                          bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  static_assert(kPending >= 0 && kPending < 8, "cp.async.wait_group range");
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0,
                                           uint32_t& r1, uint32_t& r2,
                                           uint32_t& r3) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
      : "r"(addr)
      : "memory");  // never hoisted above the __syncthreads of its K step
}

// Byte offset of 16-byte chunk `chunk` of shared row `row` in a tile: the
// chunk XOR-ed with the row's position among the 8 rows sharing one set of
// banks, so the 8 rows an ldmatrix phase reads hit 8 distinct 16-byte bank
// groups.
__device__ __forceinline__ uint32_t Swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// ------------------------------------------------------------------ helpers
// A row's target as the split pass compares it with its columns (as v3):
// int64 targets outside the int32 range become one no split holds.
__device__ __forceinline__ int RowTarget(const KernelParams& p, int r) {
  if (p.targets != nullptr) return p.targets[r];
  const int64_t t = p.targets64[r];
  return (t >= 0 && t <= INT32_MAX) ? static_cast<int>(t) : -(1 << 30);
}

__device__ __forceinline__ float RowTemperature(const KernelParams& p, int r) {
  return p.temperatures != nullptr ? p.temperatures[r] : p.temperature;
}

// A thread's share of every K step's copies, fixed for an item: chunk
// tid % 8 of rows tid / 8 + kRowStride * i of the A and B tiles. Every row a
// thread copies has the same row % 8, so one swizzled offset serves them all
// (row i's is smem_offset + kRowStride * 128 * i), and the global addresses
// are a base plus multiples of one stride: the per-step address arithmetic
// stays a few adds.
template <class T>
struct CopyPlan {
  static constexpr int kRowStride = T::kThreads / kChunksPerRow;
  static constexpr int kACopies = T::kBlockM / kRowStride;
  static constexpr int kBCopies = T::kStepCols / kRowStride;

  __device__ __forceinline__ CopyPlan(const KernelParams& p, int row0,
                                      int begin) {
    const int row = threadIdx.x / kChunksPerRow;
    const int chunk = threadIdx.x % kChunksPerRow;
    smem_offset = Swizzle(row, chunk);
    stride = static_cast<int64_t>(kRowStride) * p.hidden_size;
    a_src = p.hidden + (row0 + row) * p.hidden_size + chunk * 8;
    b_src = p.weight + (begin + row) * p.hidden_size + chunk * 8;
    a_rows_left = p.rows - (row0 + row);
    b_rows_left = p.padded_vocab - (begin + row);
  }

  const __nv_bfloat16* a_src;  // row0 + tid / 8's chunk at k = 0
  const __nv_bfloat16* b_src;  // weight row begin + tid / 8's chunk at k = 0
  int64_t stride;              // kRowStride rows, in elements
  int64_t b_rows_left;         // weight rows from begin + tid / 8 on
  int a_rows_left;             // batch rows from row0 + tid / 8 on
  uint32_t smem_offset;
};

// Issues the cp.async copies of K step `step` of an item (tile group step /
// k_blocks, kTilesPerStep tiles; k-block step % k_blocks) into ring slot
// `slot`; rows >= N and weight rows >= the padded vocabulary are
// zero-filled. The prologue's: the main loop walks the steps by CopyCursor.
template <class T>
__device__ __forceinline__ void LoadStep(const KernelParams& p,
                                         const CopyPlan<T>& plan, uint8_t* smem,
                                         int slot, int step) {
  const int tile_group = step / p.k_blocks;
  const int kb = step - tile_group * p.k_blocks;
  const int64_t k0 = static_cast<int64_t>(kb) * kBlockK;
  const uint32_t a_dst =
      SmemAddr(smem + slot * T::kStageBytes) + plan.smem_offset;
  const uint32_t b_dst = a_dst + T::kATileBytes;
  const __nv_bfloat16* a_src = plan.a_src + k0;
#pragma unroll
  for (int i = 0; i < CopyPlan<T>::kACopies; ++i) {
    const bool ok = i * CopyPlan<T>::kRowStride < plan.a_rows_left;
    CpAsync16(a_dst + i * CopyPlan<T>::kRowStride * kRowBytes,
              ok ? a_src + i * plan.stride : p.hidden, ok);
  }
  const int64_t tile_row = static_cast<int64_t>(tile_group) * T::kStepCols;
  const __nv_bfloat16* b_src = plan.b_src + tile_row * p.hidden_size + k0;
  const int64_t b_rows_left = plan.b_rows_left - tile_row;
#pragma unroll
  for (int i = 0; i < CopyPlan<T>::kBCopies; ++i) {
    const bool ok = i * CopyPlan<T>::kRowStride < b_rows_left;
    CpAsync16(b_dst + i * CopyPlan<T>::kRowStride * kRowBytes,
              ok ? b_src + i * plan.stride : p.weight, ok);
  }
}

// The main loop's copy addresses, carried from step to step by additions:
// LoadStep's per-step division and 64-bit products there spilled (this way
// nothing spills between the mma). Schedule only: the same bytes land in
// the same slots.
template <class T>
struct CopyCursor {
  __device__ __forceinline__ CopyCursor(const KernelParams& p,
                                        const CopyPlan<T>& plan, int step) {
    const int tile_group = step / p.k_blocks;
    kb = step - tile_group * p.k_blocks;
    a = plan.a_src + kb * kBlockK;
    b = plan.b_src +
        (static_cast<int64_t>(tile_group) * T::kStepCols * p.hidden_size +
         kb * kBlockK);
    b_rows_left =
        static_cast<int>(plan.b_rows_left) - tile_group * T::kStepCols;
  }
  // To the next step: the next k-block, or the next tile group's first
  // (k_blocks * kBlockK = H; relative, so the plan's bases need not stay
  // live in registers).
  __device__ __forceinline__ void Advance(const KernelParams& p) {
    a += kBlockK;
    b += kBlockK;
    if (++kb == p.k_blocks) {
      kb = 0;
      a -= p.hidden_size;
      b += static_cast<int64_t>(T::kStepCols - 1) * p.hidden_size;
      b_rows_left -= T::kStepCols;
    }
  }
  const __nv_bfloat16* a;  // this thread's A chunk of the step's k-block
  const __nv_bfloat16* b;  // its B chunk
  int kb;
  int b_rows_left;
};

// Copies [kFirst, kLast) of the cursor's step (A's kACopies, then B's) into
// the slot at a_dst; live: the step exists (past the end they zero-fill a
// free slot, rather than branch: the copies stay in the mma's basic block).
template <class T, int kFirst, int kLast>
__device__ __forceinline__ void IssueCopies(const KernelParams& p,
                                            const CopyPlan<T>& plan,
                                            const CopyCursor<T>& cur,
                                            uint32_t a_dst, bool live) {
  using Plan = CopyPlan<T>;
#pragma unroll
  for (int c = kFirst; c < kLast; ++c) {
    if (c < Plan::kACopies) {
      const bool ok = live && c * Plan::kRowStride < plan.a_rows_left;
      CpAsync16(a_dst + c * Plan::kRowStride * kRowBytes,
                ok ? cur.a + c * plan.stride : p.hidden, ok);
    } else {
      const int i = c - Plan::kACopies;
      const bool ok = live && i * Plan::kRowStride < cur.b_rows_left;
      CpAsync16(a_dst + T::kATileBytes + i * Plan::kRowStride * kRowBytes,
                ok ? cur.b + i * plan.stride : p.weight, ok);
    }
  }
}

// The mma of k16 steps [kFirst, kLast) of a K step for a warp's kWarpRows
// rows (row group `group`) x kPartCols columns (column part `part`) of each
// of the step's tiles (accumulators [tile][m16 fragment][n8 fragment]): each
// B fragment pair feeds every m16 fragment of the warp (the reuse that makes
// two fragments per warp cheaper in shared-memory reads per mma).
template <class T, int kFirst, int kLast>
__device__ __forceinline__ void ComputeK16s(const uint8_t* smem, int slot,
                                            int group, int part, int lane,
                                            float* acc) {
  constexpr int kNFrags = T::kPartCols / 8;  // n8 fragments of the warp
  constexpr int kTileAcc = 4 * kNFrags * T::kWarpMFrags;
  const uint8_t* a_tile = smem + slot * T::kStageBytes;
  const uint8_t* b_tile = a_tile + T::kATileBytes;
  const uint32_t a_base = SmemAddr(a_tile);
  const uint32_t b_base = SmemAddr(b_tile);
#pragma unroll
  for (int ks = kFirst; ks < kLast; ++ks) {
    // A fragments: lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31 the
    // same rows at k 8-15 (ldmatrix matrices a0..a3 of m16n8k16).
    uint32_t a[T::kWarpMFrags][4];
#pragma unroll
    for (int m = 0; m < T::kWarpMFrags; ++m) {
      const int row = group * T::kWarpRows + 16 * m + (lane & 15);
      const int chunk = ks * 2 + (lane >> 4);
      LdMatrixX4(a_base + Swizzle(row, chunk), a[m][0], a[m][1], a[m][2],
                 a[m][3]);
    }
    // B fragments, two n8 fragments per ldmatrix.x4: matrices (n 0-7, k 0-7),
    // (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15). The weight is
    // [n][k] in shared memory, which is the "col" operand layout.
#pragma unroll
    for (int ts = 0; ts < T::kTilesPerStep; ++ts) {
#pragma unroll
      for (int np = 0; np < kNFrags / 2; ++np) {
        const int n = ts * kBlockN + part * T::kPartCols + np * 16 +
                      (lane & 7) + ((lane >> 4) << 3);
        const int chunk = ks * 2 + ((lane >> 3) & 1);
        uint32_t b0, b1, b2, b3;
        LdMatrixX4(b_base + Swizzle(n, chunk), b0, b1, b2, b3);
#pragma unroll
        for (int m = 0; m < T::kWarpMFrags; ++m) {
          float* frag = acc + kTileAcc * ts + 4 * kNFrags * m;
          MmaM16N8K16(frag + 4 * (2 * np), a[m], b0, b1);
          MmaM16N8K16(frag + 4 * (2 * np + 1), a[m], b2, b3);
        }
      }
    }
  }
}

// Synchronises the kColumnParts warps of row group `group` (named barrier
// 1 + group; barrier 0 is __syncthreads').
template <class T>
__device__ __forceinline__ void RowGroupBarrier(int group) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "n"(32 * T::kColumnParts)
               : "memory");
}

// A tile's fold when kColumnParts warps share its 128 columns (kPartCols
// each): each runs phase 1 on its part, the rows' maxima meet in shared
// memory, then the per-thread sums run through the parts in column order
// (part q continues part q - 1's running sums: the same additions in the
// same order as one warp holding all 128 columns, epilogue::FoldTile), and
// the last part updates the states; the others keep the running max only.
// xchg: this CTA's exchange area (Tiling::kXchgBytes). Per m16 fragment of
// the warp, as FoldTile is.
template <class T, bool kEntropy>
__device__ __forceinline__ void FoldTileChained(
    const epilogue::EpilogueParams& ep, float* xchg, float* acc, int lane,
    int group, int part, int v0, int valid, const int* row, const float* inv_t,
    const int* target, RowState* state) {
  constexpr int kFragAcc = 4 * (T::kPartCols / 8);
  float* maxima = xchg + group * (T::kXchgMaxFloats + T::kXchgSumFloats);
  float* sums = maxima + T::kXchgMaxFloats;  // [fragment][s0, s1, t0, t1][lane]
  const int quad_row = lane >> 2;
  float m[2 * T::kWarpMFrags];
#pragma unroll
  for (int f = 0; f < T::kWarpMFrags; ++f) {
    float mx[2];
    epilogue::TileMaxes<T::kPartCols>(ep, acc + kFragAcc * f, lane,
                                      v0 + part * T::kPartCols,
                                      valid - part * T::kPartCols, row + 2 * f,
                                      inv_t + 2 * f, target + 2 * f, mx);
    const float quad_max0 = epilogue::QuadMax(mx[0]);
    const float quad_max1 = epilogue::QuadMax(mx[1]);
    if ((lane & 3) == 0) {
      maxima[part * T::kWarpRows + 16 * f + quad_row] = quad_max0;
      maxima[part * T::kWarpRows + 16 * f + quad_row + 8] = quad_max1;
    }
  }
  RowGroupBarrier<T>(group);
#pragma unroll
  for (int f = 0; f < T::kWarpMFrags; ++f) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float row_max = -INFINITY;
#pragma unroll
      for (int q = 0; q < T::kColumnParts; ++q) {
        row_max = fmaxf(row_max,
                        maxima[q * T::kWarpRows + 16 * f + quad_row + 8 * h]);
      }
      m[2 * f + h] = fmaxf(state[2 * f + h].max, row_max * inv_t[2 * f + h]);
    }
  }
  float s[2 * T::kWarpMFrags] = {}, t[2 * T::kWarpMFrags] = {};
#pragma unroll
  for (int q = 0; q < T::kColumnParts; ++q) {
    if (part == q) {  // warp-uniform
#pragma unroll
      for (int f = 0; f < T::kWarpMFrags; ++f) {
        float* cell = sums + f * 128 + lane;
        if (q > 0) {
          s[2 * f] = cell[0];
          s[2 * f + 1] = cell[32];
          t[2 * f] = cell[64];
          t[2 * f + 1] = cell[96];
        }
        epilogue::TileExpSums<T::kPartCols, kEntropy>(
            acc + kFragAcc * f, valid >= kBlockN, inv_t + 2 * f, m + 2 * f,
            s + 2 * f, t + 2 * f);
        if (q + 1 < T::kColumnParts) {
          cell[0] = s[2 * f];
          cell[32] = s[2 * f + 1];
          cell[64] = t[2 * f];
          cell[96] = t[2 * f + 1];
        }
      }
    }
    if (q + 1 < T::kColumnParts) RowGroupBarrier<T>(group);
  }
#pragma unroll
  for (int f = 0; f < T::kWarpMFrags; ++f) {
    if (part == T::kColumnParts - 1) {
      epilogue::UpdateStates<kEntropy>(m + 2 * f, s + 2 * f, t + 2 * f,
                                       state + 2 * f);
    } else {
      state[2 * f].max = m[2 * f];
      state[2 * f + 1].max = m[2 * f + 1];
    }
  }
}

// One CTA per item, in the item order of kernels/item_order.h: row blocks
// row_group at a time, the row block fastest (the row blocks of a group run
// together and share a split's weight rows in L2; a group's hidden rows
// stay in L2 while its splits go by).
template <class T, bool kEntropy, bool kTopK>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocksPerSm)
    LinearLogpPortableSplitKernel(const __grid_constant__ KernelParams p) {
  static_assert(!kTopK || T::kColumnParts == 1, "top-k lists need whole tiles");
  constexpr int kFragAcc = 4 * (T::kPartCols / 8);     // per m16 fragment
  constexpr int kTileAcc = kFragAcc * T::kWarpMFrags;  // per tile
  constexpr int kAcc = kTileAcc * T::kTilesPerStep;
  constexpr int kRows = 2 * T::kWarpMFrags;  // rows a thread holds
  extern __shared__ __align__(128) uint8_t smem[];
  const RowBlockAndSplit item =
      DecodeItem(static_cast<int>(blockIdx.x), p.num_row_blocks, p.num_splits,
                 p.row_group);
  const int split = item.split;
  const int row_block = item.row_block;
  const int begin = p.split_begin[split];
  const int end = p.split_begin[split + 1];
  const int tiles = (end - begin + kBlockN - 1) / kBlockN;
  const int tile_groups = (tiles + T::kTilesPerStep - 1) / T::kTilesPerStep;
  const int steps = tile_groups * p.k_blocks;
  const int row0 = row_block * T::kBlockM;

  // Broadcast so that the compiler sees warp-uniform values.
  const int warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const int group = warp / T::kColumnParts;  // row group
  const int part = warp - group * T::kColumnParts;
  const int lane = threadIdx.x & 31;
  const bool active = row0 + group * T::kWarpRows < p.rows;

  float* top_z = reinterpret_cast<float*>(smem + T::kRingBytes);
  int32_t* top_id = reinterpret_cast<int32_t*>(top_z + T::kBlockM * kMaxTopK);
  float* xchg = reinterpret_cast<float*>(smem + T::kRingBytes + T::kListBytes);
  TopKLists lists[T::kWarpMFrags];
  int row[kRows], target[kRows];
  float inv_t[kRows];
  RowState state[kRows];
#pragma unroll
  for (int m = 0; m < T::kWarpMFrags; ++m) {
    lists[m] = epilogue::MakeTopKLists(
        top_z, top_id, group * T::kWarpRows + 16 * m, T::kBlockM);
    if constexpr (kTopK) epilogue::TopKReset(lists[m], p.top_k, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + lists[m].row0 + (lane >> 2) + 8 * h;
      const int i = 2 * m + h;
      row[i] = r;
      const bool in = r < p.rows;
      inv_t[i] = in ? __frcp_rn(RowTemperature(p, r)) : 1.0f;
      target[i] = in ? RowTarget(p, r) : -(1 << 30);
      state[i] = RowState{-INFINITY, 0.0f, 0.0f, -INFINITY};
    }
  }
  // kRowsInSmem: the rows' values live in shared memory between folds; each
  // fold reloads them whole, so the registers above are dead in the main
  // loop. Only the part that owns the sums writes states back (the others
  // hold the same maxima).
  RowState* smem_state = reinterpret_cast<RowState*>(smem + T::kRowsOffset);
  float* smem_inv_t = reinterpret_cast<float*>(smem_state + T::kBlockM);
  int* smem_target = reinterpret_cast<int*>(smem_inv_t + T::kBlockM);
  const auto block_row = [&](int i) {
    return group * T::kWarpRows + 16 * (i / 2) + (lane >> 2) + 8 * (i % 2);
  };
  const auto store_rows = [&](bool inputs_too) {
    if constexpr (T::kRowsInSmem) {
      if ((lane & 3) != 0 || part != T::kColumnParts - 1) return;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        smem_state[block_row(i)] = state[i];
        if (inputs_too) {
          smem_inv_t[block_row(i)] = inv_t[i];
          smem_target[block_row(i)] = target[i];
        }
      }
    }
  };
  const auto load_rows = [&] {
    if constexpr (T::kRowsInSmem) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        row[i] = row0 + block_row(i);
        state[i] = smem_state[block_row(i)];
        inv_t[i] = smem_inv_t[block_row(i)];
        target[i] = smem_target[block_row(i)];
      }
    }
  };
  store_rows(true);
  if constexpr (T::kRowsInSmem) __syncthreads();  // other parts read them
  const epilogue::EpilogueParams ep{
      p.bias, p.logprobs, {p.top_screen, p.top_k, p.id_offset, p.rows}};

  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

  // Prologue: steps 0 .. kStages-2 in flight (empty groups past the end keep
  // the group count uniform).
  const CopyPlan<T> plan(p, row0, begin);
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (s < steps) LoadStep<T>(p, plan, smem, s, s);
    CpAsyncCommit();
  }
  constexpr int kK16s = kBlockK / 16;
  // The next step's copies go out in three pieces between the four k16
  // steps' mma, in one basic block, so that ptxas interleaves them (and
  // their address arithmetic) with the mma rather than stall the tensor
  // cores on a run of copies.
  static_assert(kK16s == 4, "the copies go out in three pieces");
  constexpr int kCopies = CopyPlan<T>::kACopies + CopyPlan<T>::kBCopies;
  constexpr int kCopies1 = kCopies / 3, kCopies2 = 2 * kCopies / 3;
  CopyCursor<T> cur(p, plan, T::kStages - 1);
  int slot = 0, next_slot = T::kStages - 1;
  int kb = 0, tile_group = 0;  // the step's position, counted
  for (int step = 0; step < steps; ++step) {
    CpAsyncWait<T::kStages - 2>();  // step's group has landed (this thread's)
    __syncthreads();                // ... every thread's; slot step-1 is free
    const bool live = step + T::kStages - 1 < steps;
    const uint32_t a_dst =
        SmemAddr(smem + next_slot * T::kStageBytes) + plan.smem_offset;
    if (active) {
      ComputeK16s<T, 0, 1>(smem, slot, group, part, lane, acc);
      IssueCopies<T, 0, kCopies1>(p, plan, cur, a_dst, live);
      ComputeK16s<T, 1, 2>(smem, slot, group, part, lane, acc);
      IssueCopies<T, kCopies1, kCopies2>(p, plan, cur, a_dst, live);
      ComputeK16s<T, 2, 3>(smem, slot, group, part, lane, acc);
      IssueCopies<T, kCopies2, kCopies>(p, plan, cur, a_dst, live);
      ComputeK16s<T, 3, 4>(smem, slot, group, part, lane, acc);
    } else {
      IssueCopies<T, 0, kCopies>(p, plan, cur, a_dst, live);
    }
    CpAsyncCommit();
    cur.Advance(p);
    slot = slot + 1 == T::kStages ? 0 : slot + 1;
    next_slot = next_slot + 1 == T::kStages ? 0 : next_slot + 1;
    if (++kb == p.k_blocks) {  // the tile group's last k-block
      kb = 0;
      if (active) {
        load_rows();
#pragma unroll
        for (int ts = 0; ts < T::kTilesPerStep; ++ts) {
          const int tile = tile_group * T::kTilesPerStep + ts;
          if (tile >= tiles) break;  // a split's odd last tile: not folded
          const int v0 = begin + tile * kBlockN;
          float* tile_acc = acc + kTileAcc * ts;
          if constexpr (T::kColumnParts > 1) {
            FoldTileChained<T, kEntropy>(ep, xchg, tile_acc, lane, group, part,
                                         v0, end - v0, row, inv_t, target,
                                         state);
          } else {
#pragma unroll
            for (int m = 0; m < T::kWarpMFrags; ++m) {
              epilogue::FoldTile<kBlockN, kEntropy, kTopK,
                                 epilogue::SlotBoundKind::kMerged>(
                  ep, tile_acc + kFragAcc * m, lane, v0, end - v0, row + 2 * m,
                  inv_t + 2 * m, target + 2 * m, state + 2 * m, lists[m]);
            }
          }
        }
        store_rows(false);
      }
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
      ++tile_group;
    }
  }
  CpAsyncWait<0>();

  // The last column part holds the states' sums.
  if (!active || part != T::kColumnParts - 1) return;
  load_rows();
  if ((lane & 3) == 0) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (row[i] < p.rows) {
        epilogue::StoreSplitPartials(
            p.split_lse, kEntropy ? p.split_mean_z : nullptr,
            static_cast<int64_t>(row[i]) * p.num_splits + split, state[i],
            inv_t[i]);
      }
    }
  }
  if constexpr (kTopK) {
#pragma unroll
    for (int m = 0; m < T::kWarpMFrags; ++m) {
      epilogue::StoreTopKLists(lists[m], p.top_k, lane, row0, p.rows,
                               p.num_splits, split, p.split_top_z,
                               p.split_top_id);
    }
  }
}

}  // namespace detlogp::kernels::cuda::portable_v1

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_KERNEL_CUH_
