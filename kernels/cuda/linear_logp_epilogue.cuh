// The per-tile epilogue both linear-logp kernels share (the Hopper kernel
// sm90a-wgmma-v3, linear_logp_kernel.cuh, and the portable mma.sync kernel,
// linear_logp_portable_kernel.cuh): the fold of a finished tile of kW
// vocabulary columns into each row's online softmax state, the target's z,
// the entropy sum and the top-k lists. Both kernels hold a tile the same
// way (m16n8 fragments: a thread holds two rows, lane / 4 and lane / 4 + 8,
// and columns 8j + 2 (lane % 4) + {0, 1}), so one copy of this arithmetic
// serves both (their bits still differ: different mma, different keys).
// Each translation unit compiles its own copy for its own architectures.
// The top-k selection it calls lives in linear_logp_topk.cuh.
//
// A tile: y = acc + bias; the tile max of z = y / T is fl(max(y) * (1/T))
// (rounding is monotone, 1/T > 0); exp(z - m) is ex2(y * (log2e / T) -
// m * log2e); per-thread sums in fixed column order, then a fixed
// xor-shuffle over the row's quad (1, then 2); z[target] = y * (1/T).
// Build flags matter for bits: no --use_fast_math / -ftz / -prec-div.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_EPILOGUE_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_EPILOGUE_CUH_

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/linear_logp_topk.cuh"
#include "kernels/softmax_partial.h"

namespace detlogp::kernels::cuda::epilogue {

// What the epilogue reads and writes besides the accumulators.
struct EpilogueParams {
  const float* bias;  // [padded_vocab] or null
  float* logprobs;    // [rows]: z[target]
  TopKParams top;     // kTopK only
};

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// acc[4 * j + k] for a run-time j < kJ and k in [0, 4), through a switch
// and scalars so that the accumulators stay in registers (an indexed array,
// even of four, gets turned into local memory by the compiler).
template <int kJ>
__device__ __forceinline__ float SelectFragment(const float* acc, int j,
                                                int k) {
  float v0 = 0.0f, v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
  // clang-format off
  switch (j) {
#define DETLOGP_CASE(J)        \
  case J:                      \
    if constexpr (J < kJ) {    \
      v0 = acc[4 * J + 0];     \
      v1 = acc[4 * J + 1];     \
      v2 = acc[4 * J + 2];     \
      v3 = acc[4 * J + 3];     \
    }                          \
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
      break;
  }
  // clang-format on
  return k == 0 ? v0 : (k == 1 ? v1 : (k == 2 ? v2 : v3));
}

struct RowState {
  float max;
  float sum;
  float sum_y;   // sum of exp(z - max) * y (kEntropy only)
  float screen;  // the split's tightest top-k screen so far (kTopK only)
};

// A tile's fold in phases, so that a kernel whose warps split a tile's
// columns between them (the portable kernel's narrow tiling) can chain them
// and keep every row's arithmetic the same (FoldTile below is the whole).

// Phase 1: y = acc + bias in place (columns at or past `valid` become
// -inf), z[target] written by the thread holding it, and the thread's max of
// y per row (mx[0], mx[1]) over its kW / 8 fragments. With kGroups (top-k),
// also the maxima of its 8-value groups (GroupMax) into `groups`, taken on
// the way: mx is then the max of the group maxima, the same value (max is
// exact; only a zero's sign could differ, and m = 0 gives the same exps,
// sums and logsumexp either way).
template <int kW, bool kGroups = false>
__device__ __forceinline__ void TileMaxes(const EpilogueParams& p, float* acc,
                                          int lane, int v0, int valid,
                                          const int* row, const float* inv_t,
                                          const int* target, float* mx,
                                          GroupMaxima<kW>* groups = nullptr) {
  const int quad = lane & 3;
  const int limit = valid < kW ? valid : kW;
  float mx0 = -INFINITY, mx1 = -INFINITY;
  // With kGroups, mx is taken group by group, after each group's last
  // fragment j.
  const auto end_of_fragment = [&](int j) {
    if constexpr (kGroups) {
      if (j % 4 == 3) {
        groups->v[0][j / 4] = GroupMax(acc, 0, j / 4);
        groups->v[1][j / 4] = GroupMax(acc, 1, j / 4);
        mx0 = fmaxf(mx0, groups->v[0][j / 4]);
        mx1 = fmaxf(mx1, groups->v[1][j / 4]);
      }
    }
  };
  if (limit == kW) {
#pragma unroll
    for (int j = 0; j < kW / 8; ++j) {
      float2 b = make_float2(0.0f, 0.0f);
      if (p.bias != nullptr) {
        b = __ldg(
            reinterpret_cast<const float2*>(p.bias + v0 + 8 * j + 2 * quad));
      }
      acc[4 * j + 0] += b.x;
      acc[4 * j + 1] += b.y;
      acc[4 * j + 2] += b.x;
      acc[4 * j + 3] += b.y;
      if constexpr (kGroups) {
        end_of_fragment(j);
      } else {
        mx0 = fmaxf(mx0, fmaxf(acc[4 * j + 0], acc[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(acc[4 * j + 2], acc[4 * j + 3]));
      }
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
        if constexpr (!kGroups) {
          mx0 = fmaxf(mx0, acc[4 * j + e]);
          mx1 = fmaxf(mx1, acc[4 * j + 2 + e]);
        }
      }
      end_of_fragment(j);
    }
  }
  // The target logit: only the one thread holding it does any work.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int tcol = target[h] - v0;
    if (tcol >= 0 && tcol < limit && ((tcol >> 1) & 3) == quad) {
      const float y =
          SelectFragment<kW / 8>(acc, tcol >> 3, 2 * h + (tcol & 1));
      p.logprobs[row[h]] = y * inv_t[h];
    }
  }
  mx[0] = mx0;
  mx[1] = mx1;
}

// The max over a row's quad (lanes 4r .. 4r + 3): xor-shuffles 1, then 2.
__device__ __forceinline__ float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The sum over a row's quad, in that fixed order.
__device__ __forceinline__ float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Phase 2: continues the thread's per-row sums s = sum exp(z - m) and (with
// kEntropy) t = sum exp(z - m) * y over its kW / 8 fragments, in fixed
// column order, with m the rows' new running max. tile_full: the whole tile
// (all of its parts) is inside the vocabulary; otherwise masked columns'
// y = -inf enter t clamped to -FLT_MAX so that 0 * y stays 0.
template <int kW, bool kEntropy>
__device__ __forceinline__ void TileExpSums(const float* acc, bool tile_full,
                                            const float* inv_t, const float* m,
                                            float* s, float* t) {
  constexpr float kLog2e = 1.4426950408889634f;
  const float c0 = -m[0] * kLog2e;
  const float c1 = -m[1] * kLog2e;
  const float k0 = inv_t[0] * kLog2e;
  const float k1 = inv_t[1] * kLog2e;
  const float y_floor = tile_full ? -INFINITY : -FLT_MAX;
  float s0 = s[0], s1 = s[1], t0 = t[0], t1 = t[1];
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
  s[0] = s0;
  s[1] = s1;
  t[0] = t0;
  t[1] = t1;
}

// Phase 3: the quads' sums rescale into the rows' online states.
template <bool kEntropy>
__device__ __forceinline__ void UpdateStates(const float* m, const float* s,
                                             const float* t, RowState* state) {
  constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = QuadSum(s[h]);
    const float r = Ex2((state[h].max - m[h]) * kLog2e);
    state[h].sum = state[h].sum * r + sum;
    if constexpr (kEntropy) {
      state[h].sum_y = state[h].sum_y * r + QuadSum(t[h]);
    }
    state[h].max = m[h];
  }
}

// Folds a finished tile of kW columns starting at v0 (valid columns:
// `valid`, may exceed kW) into the thread's two rows' states (row, inv_t and
// target per row), writes z[target] where the thread holds it, and with
// kTopK screens the tile into the rows' lists, after the exp sums, with the
// rows' screen words loaded as the fold starts (their latency hides behind
// the exp sums). kSlotBound: how the top-k screens read the slots
// (linear_logp_topk.cuh). A kernel that can load the words ahead uses
// FoldTileScreenedFirst.
template <int kW, bool kEntropy, bool kTopK,
          SlotBoundKind kSlotBound = SlotBoundKind::kQuadLeast>
__device__ __forceinline__ void FoldTile(const EpilogueParams& p, float* acc,
                                         int lane, int v0, int valid,
                                         const int* row, const float* inv_t,
                                         const int* target, RowState* state,
                                         const TopKLists& lists) {
  float shared[2];
  if constexpr (kTopK) {
    shared[0] = LoadRowScreen(p.top, row[0]);
    shared[1] = LoadRowScreen(p.top, row[1]);
  }
  float mx[2];
  TileMaxes<kW>(p, acc, lane, v0, valid, row, inv_t, target, mx);
  const float m[2] = {fmaxf(state[0].max, QuadMax(mx[0]) * inv_t[0]),
                      fmaxf(state[1].max, QuadMax(mx[1]) * inv_t[1])};
  float s[2] = {0.0f, 0.0f}, t[2] = {0.0f, 0.0f};
  TileExpSums<kW, kEntropy>(acc, valid >= kW, inv_t, m, s, t);
  UpdateStates<kEntropy>(m, s, t, state);
  if constexpr (kTopK) {
    float carried[2] = {state[0].screen, state[1].screen};
    TopKTile<kW, kSlotBound, false>(p.top, acc, GroupMaxima<kW>{}, lane, v0,
                                    row, inv_t, mx, shared, carried, lists);
    state[0].screen = carried[0];
    state[1].screen = carried[1];
  }
}

// FoldTile for a kernel that loaded the rows' screen words ahead (their
// keys, LoadRowScreenKey), with top-k: the tile is screened right after its
// maxima pass, which hands over the group maxima, and before the exp sums
// (acc is not changed by them, so every output is as FoldTile's). The group
// maxima are dead before the exp sums, so they cost no registers there.
template <int kW, bool kEntropy,
          SlotBoundKind kSlotBound = SlotBoundKind::kQuadLeast>
__device__ __forceinline__ void FoldTileScreenedFirst(
    const EpilogueParams& p, float* acc, int lane, int v0, int valid,
    const int* row, const float* inv_t, const int* target, RowState* state,
    const TopKLists& lists, const uint32_t* screen_keys) {
  float mx[2];
  GroupMaxima<kW> groups;
  TileMaxes<kW, true>(p, acc, lane, v0, valid, row, inv_t, target, mx, &groups);
  const float m[2] = {fmaxf(state[0].max, QuadMax(mx[0]) * inv_t[0]),
                      fmaxf(state[1].max, QuadMax(mx[1]) * inv_t[1])};
  const float shared[2] = {ScreenValue(screen_keys[0]),
                           ScreenValue(screen_keys[1])};
  float carried[2] = {state[0].screen, state[1].screen};
  TopKTile<kW, kSlotBound, true>(p.top, acc, groups, lane, v0, row, inv_t, mx,
                                 shared, carried, lists);
  float s[2] = {0.0f, 0.0f}, t[2] = {0.0f, 0.0f};
  TileExpSums<kW, kEntropy>(acc, valid >= kW, inv_t, m, s, t);
  UpdateStates<kEntropy>(m, s, t, state);
  state[0].screen = carried[0];
  state[1].screen = carried[1];
}

// Writes a row's split partials once the split is done: its logsumexp
// ({max, sum} as the equivalent {lse_s, 1}: 4 bytes instead of 8) and, when
// split_mean_z is set, its mean z.
__device__ __forceinline__ void StoreSplitPartials(float* split_lse,
                                                   float* split_mean_z,
                                                   int64_t cell,
                                                   const RowState& state,
                                                   float inv_t) {
  split_lse[cell] = state.max + logf(state.sum);
  if (split_mean_z != nullptr) {
    split_mean_z[cell] = (state.sum_y / state.sum) * inv_t;
  }
}

}  // namespace detlogp::kernels::cuda::epilogue

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_EPILOGUE_CUH_
