// Bit equality of LogpClient answers, for tests that send the same rows by
// different paths (message bytes, regions, cut or spread calls).
#ifndef DETLOGP_TESTS_SCORE_RESULT_BITS_H_
#define DETLOGP_TESTS_SCORE_RESULT_BITS_H_

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "client/logp_client.h"

namespace detlogp::testing {

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Every answer field holds the same bits, and there are rows to compare.
inline bool SameBits(const client::ScoreResult& a,
                     const client::ScoreResult& b) {
  return !a.logprobs.empty() && SameBits(a.logprobs, b.logprobs) &&
         SameBits(a.lse, b.lse) && SameBits(a.entropy, b.entropy) &&
         SameBits(a.top_ids, b.top_ids) &&
         SameBits(a.top_logprobs, b.top_logprobs);
}

// The same as expectations, field by field, and the same determinism key.
inline void ExpectSameBits(const client::ScoreResult& a,
                           const client::ScoreResult& b) {
  EXPECT_FALSE(a.logprobs.empty());
  EXPECT_TRUE(SameBits(a.logprobs, b.logprobs));
  EXPECT_TRUE(SameBits(a.lse, b.lse));
  EXPECT_TRUE(SameBits(a.entropy, b.entropy));
  EXPECT_TRUE(SameBits(a.top_ids, b.top_ids));
  EXPECT_TRUE(SameBits(a.top_logprobs, b.top_logprobs));
  EXPECT_EQ(a.determinism_key, b.determinism_key);
}

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_SCORE_RESULT_BITS_H_
