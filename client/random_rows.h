// Random bf16 hidden rows ~ N(0, 1) and targets, for demos and checks.
#ifndef DETLOGP_CLIENT_RANDOM_ROWS_H_
#define DETLOGP_CLIENT_RANDOM_ROWS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/random_normal.h"

namespace detlogp::client {

// `rows` x `hidden_size` bf16 values as raw little-endian bytes.
inline std::string RandomBf16Rows(int64_t rows, int64_t hidden_size,
                                  uint64_t seed) {
  kernels::RandomNormal random(seed);
  std::string data(rows * hidden_size * 2, '\0');
  for (int64_t i = 0; i < rows * hidden_size; ++i) {
    const uint16_t bits = kernels::FloatToBf16(random.Next(1.0f));
    data[2 * i] = static_cast<char>(bits & 0xff);
    data[2 * i + 1] = static_cast<char>(bits >> 8);
  }
  return data;
}

inline std::vector<int64_t> RandomTargets(int64_t rows, int64_t vocab_size,
                                          uint64_t seed) {
  std::vector<int64_t> targets(rows);
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int64_t& target : targets) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    target = static_cast<int64_t>(state % static_cast<uint64_t>(vocab_size));
  }
  return targets;
}

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_RANDOM_ROWS_H_
