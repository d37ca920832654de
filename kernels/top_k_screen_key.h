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

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_TOP_K_SCREEN_KEY_H_
