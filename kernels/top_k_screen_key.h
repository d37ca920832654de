// Order-preserving uint32 keys of floats: a < b implies
// ScreenKey(a) < ScreenKey(b), so that a top-k screen (a lower bound on a
// row's k-th best z) can be raised by many writers with an integer atomicMax
// (kernels/cuda/linear_logp_topk.cuh). Key 0, what a cleared workspace
// holds, lies below every float and reads back as -inf.
#ifndef DETLOGP_KERNELS_TOP_K_SCREEN_KEY_H_
#define DETLOGP_KERNELS_TOP_K_SCREEN_KEY_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace detlogp::kernels {

// Non-negative floats above every negative one (sign bit set); negative
// ones bit-inverted, so that a larger magnitude gives a smaller key.
DETLOGP_HOST_DEVICE inline uint32_t ScreenKey(float z) {
  uint32_t b;
  std::memcpy(&b, &z, sizeof(b));
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

// The float of a key; keys at or below -inf's (0 and NaN patterns) give
// -inf.
DETLOGP_HOST_DEVICE inline float ScreenValue(uint32_t key) {
  if (key <= 0x007fffffu) return -INFINITY;
  const uint32_t b = (key & 0x80000000u) != 0 ? (key & 0x7fffffffu) : ~key;
  float z;
  std::memcpy(&z, &b, sizeof(z));
  return z;
}

// Slots a row's top-k screens gather maxima in (linear_logp_topk.cuh): the
// slot of one thread's columns (quad: the thread's place among a row's four)
// of the tile starting at column v0, in 16 groups of four, the group the top
// four bits of a mixed (murmur3 finalizer) tile index. Split starts step by
// a near-constant number of 32-column units (~36 at V = 151936), which the
// plain (v0 / 32) mod 16 put into 4 of the 16 groups, so the first tiles of
// a row's splits, which fold at the same time, could not fill enough slots
// to bound anything; a Fibonacci hash did no better on that progression
// (docs/kernels.md, "Top-k screens"). Any map works for correctness as
// long as one thread's columns of one tile go to one slot: slots then
// gather disjoint column sets.
inline constexpr int kScreenSlots = 64;

DETLOGP_HOST_DEVICE inline int ScreenSlot(int v0, int quad) {
  static_assert(kScreenSlots == 64, "16 groups of 4");
  uint32_t x = static_cast<uint32_t>(v0) >> 5;
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return static_cast<int>(x >> 28) * 4 + quad;
}

// Batcher's odd-even merge sort of kN keys, descending, as a fixed network:
// 63 compare-exchanges for 16 keys, each one max and one min. Sorting keys
// sorts their floats (ScreenValue is monotone). The network is unrolled at
// compile time by recursion over the loops (p, k, j, i) of the iterative
// form, so that device code sorts registers: nested loops that double or
// halve their counters are not unrolled by the CUDA compiler, and the keys
// went to local memory.
template <int kN, int P, int K, int J, int I>
DETLOGP_HOST_DEVICE inline void BatcherSteps(uint32_t* keys) {
  if constexpr (P < kN) {
    if constexpr (K == 0) {  // next p; k starts at p, j at k % p = 0
      BatcherSteps<kN, 2 * P, 2 * P, 0, 0>(keys);
    } else if constexpr (J + K >= kN) {  // next k
      BatcherSteps<kN, P, K / 2, (K / 2) % P, 0>(keys);
    } else if constexpr (I == K) {  // next j
      BatcherSteps<kN, P, K, J + 2 * K, 0>(keys);
    } else {
      constexpr int kA = I + J;
      constexpr int kB = I + J + K;
      if constexpr (kB < kN && kA / (2 * P) == kB / (2 * P)) {
        const uint32_t a = keys[kA];
        const uint32_t b = keys[kB];
        keys[kA] = a > b ? a : b;
        keys[kB] = a > b ? b : a;
      }
      BatcherSteps<kN, P, K, J, I + 1>(keys);
    }
  }
}

template <int kN>
DETLOGP_HOST_DEVICE inline void SortKeysDescending(uint32_t* keys) {
  static_assert(kN > 0 && (kN & (kN - 1)) == 0, "a power of two");
  BatcherSteps<kN, 1, 1, 0, 0>(keys);
}

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_TOP_K_SCREEN_KEY_H_
