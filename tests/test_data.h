// Random lm_heads and rows for kernel tests: fresh random data, never zeros.
#ifndef DETLOGP_TESTS_TEST_DATA_H_
#define DETLOGP_TESTS_TEST_DATA_H_

#include <cstdint>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/lm_head.h"
#include "kernels/random_normal.h"

namespace detlogp::testing {

// Owns the storage behind an LmHeadView.
struct TestLmHead {
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t padded_vocab_size = 0;
  std::vector<uint16_t> weight;
  std::vector<float> bias;

  kernels::LmHeadView view() const {
    return {hidden_size, vocab_size, padded_vocab_size, weight.data(),
            bias.empty() ? nullptr : bias.data()};
  }
};

// W ~ N(0, 0.02^2), bias ~ N(0, 0.1^2); padding rows get huge values so any
// leak of padding into the softmax shows.
inline TestLmHead MakeTestLmHead(int64_t hidden_size, int64_t vocab_size,
                                 int64_t padded_vocab_size, bool with_bias,
                                 uint64_t seed) {
  TestLmHead head;
  head.hidden_size = hidden_size;
  head.vocab_size = vocab_size;
  head.padded_vocab_size = padded_vocab_size;
  kernels::RandomNormal random(seed);
  head.weight.resize(padded_vocab_size * hidden_size);
  for (int64_t v = 0; v < padded_vocab_size; ++v) {
    for (int64_t k = 0; k < hidden_size; ++k) {
      head.weight[v * hidden_size + k] =
          kernels::FloatToBf16(v < vocab_size ? random.Next(0.02f) : 8.0f);
    }
  }
  if (with_bias) {
    head.bias.resize(padded_vocab_size);
    for (int64_t v = 0; v < padded_vocab_size; ++v) {
      head.bias[v] = v < vocab_size ? random.Next(0.1f) : 1e4f;
    }
  }
  return head;
}

// The same head with its padding rows dropped: a padded head must give the
// same bits.
inline TestLmHead WithoutPadding(TestLmHead head) {
  head.padded_vocab_size = head.vocab_size;
  head.weight.resize(head.vocab_size * head.hidden_size);
  if (!head.bias.empty()) head.bias.resize(head.vocab_size);
  return head;
}

inline std::vector<uint16_t> RandomHidden(int64_t rows, int64_t hidden_size,
                                          uint64_t seed) {
  kernels::RandomNormal random(seed);
  std::vector<uint16_t> hidden(rows * hidden_size);
  for (uint16_t& h : hidden) h = kernels::FloatToBf16(random.Next(1.0f));
  return hidden;
}

inline std::vector<int32_t> RandomTargets(int64_t rows, int64_t vocab_size,
                                          uint64_t seed) {
  std::vector<int32_t> targets(rows);
  uint64_t state = seed * 2654435761u + 12345;
  for (int32_t& t : targets) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    t = static_cast<int32_t>((state >> 33) % vocab_size);
  }
  return targets;
}

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_TEST_DATA_H_
