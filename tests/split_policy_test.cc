#include "kernels/split_policy.h"

#include <gtest/gtest.h>

namespace detlogp::kernels {
namespace {

// Every vocabulary is covered exactly once by contiguous, non-empty,
// ascending splits whose inner boundaries sit on granules.
void ExpectValidPartition(int64_t vocab_size) {
  const int32_t splits = NumVocabSplits(vocab_size);
  ASSERT_GE(splits, 1);
  ASSERT_LE(splits, kMaxVocabSplits);
  int64_t expected_begin = 0;
  for (int32_t s = 0; s < splits; ++s) {
    const VocabRange range = VocabSplitRange(vocab_size, s);
    EXPECT_EQ(range.begin, expected_begin) << "V=" << vocab_size << " s=" << s;
    EXPECT_GT(range.end, range.begin) << "empty split, V=" << vocab_size;
    EXPECT_EQ(range.begin % kSplitGranule, 0);
    expected_begin = range.end;
  }
  EXPECT_EQ(expected_begin, vocab_size);
}

TEST(SplitPolicyTest, PartitionsEdgeVocabularies) {
  for (int64_t v : {1, 2, 63, 64, 65, 127, 128, 129, 2049, 4097, 8191, 8192,
                    8193, 32000, 151936, 152064, 262144, 1000003}) {
    ExpectValidPartition(v);
  }
}

TEST(SplitPolicyTest, PartitionsEveryVocabularyUpTo20000) {
  for (int64_t v = 1; v <= 20000; ++v) ExpectValidPartition(v);
}

TEST(SplitPolicyTest, SmallVocabulariesGetOneSplitPerGranule) {
  EXPECT_EQ(NumVocabSplits(63), 1);
  EXPECT_EQ(NumVocabSplits(64), 1);
  EXPECT_EQ(NumVocabSplits(65), 2);
  EXPECT_EQ(NumVocabSplits(2049), 33);
}

TEST(SplitPolicyTest, LargeVocabulariesUseMaxSplitsEvenly) {
  EXPECT_EQ(NumVocabSplits(151936), kMaxVocabSplits);
  // 2374 granules over 132 splits: 17 or 18 granules each, so at N = 1 no
  // multiprocessor streams more than 1/132 of the weight (rounded up).
  for (int32_t s = 0; s < kMaxVocabSplits; ++s) {
    const VocabRange r = VocabSplitRange(151936, s);
    const int64_t granules =
        (r.end - r.begin + kSplitGranule - 1) / kSplitGranule;
    EXPECT_GE(granules, 17);
    EXPECT_LE(granules, 18);
  }
}

TEST(SplitPolicyTest, PolicyNameIsVersioned) {
  EXPECT_STREQ(kSplitPolicyName, "v-only/granule64/max132/v2");
}

}  // namespace
}  // namespace detlogp::kernels
