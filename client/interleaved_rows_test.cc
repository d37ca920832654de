#include "client/interleaved_rows.h"

#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace detlogp::client {
namespace {

// Every request row lands on exactly one call, at the call row the server's
// chunks (of block_rows rows) put it, and each call's x holds those rows.
void ExpectCoversEveryRowOnce(int64_t rows, int64_t block_rows, int max_calls) {
  SCOPED_TRACE(testing::Message() << rows << " rows, blocks of " << block_rows
                                  << ", " << max_calls << " calls at most");
  const InterleavedRows plan(rows, block_rows, max_calls);
  constexpr int64_t kRowFloats = 3;
  std::vector<float> x(static_cast<size_t>(rows * kRowFloats));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  std::set<int64_t> seen;
  int64_t total = 0;
  for (int c = 0; c < plan.calls(); ++c) {
    const std::vector<float> call_x =
        plan.GatherCallRows(x.data(), kRowFloats, c);
    ASSERT_EQ(static_cast<int64_t>(call_x.size()),
              plan.CallRows(c) * kRowFloats);
    for (int64_t r = 0; r < plan.CallRows(c); ++r) {
      const int64_t row = plan.RequestRow(c, r);
      ASSERT_GE(row, 0);
      ASSERT_LT(row, rows);
      EXPECT_TRUE(seen.insert(row).second) << "row " << row << " twice";
      EXPECT_EQ(plan.CallOfBlock(row / block_rows), c);
      for (int64_t f = 0; f < kRowFloats; ++f) {
        ASSERT_EQ(call_x[r * kRowFloats + f], x[row * kRowFloats + f]);
      }
    }
    total += plan.CallRows(c);
  }
  EXPECT_EQ(total, rows);
  EXPECT_EQ(static_cast<int64_t>(seen.size()), rows);
}

TEST(InterleavedRows, EveryRowOnceOnTheCallOfItsBlock) {
  ExpectCoversEveryRowOnce(10, 3, 2);  // short last block on call 1
  ExpectCoversEveryRowOnce(12, 3, 4);  // whole blocks, one per call
  ExpectCoversEveryRowOnce(13, 3, 4);  // a fifth, short block on call 0
  ExpectCoversEveryRowOnce(1000, 7, 3);
  ExpectCoversEveryRowOnce(5, 8, 4);  // one block: one call
  ExpectCoversEveryRowOnce(0, 8, 4);
}

TEST(InterleavedRows, NoMoreCallsThanBlocks) {
  EXPECT_EQ(InterleavedRows(10, 4, 8).calls(), 3);
  EXPECT_EQ(InterleavedRows(10, 4, 2).calls(), 2);
  EXPECT_EQ(InterleavedRows(0, 4, 8).calls(), 1);
  EXPECT_EQ(InterleavedRows(10, 4, 0).calls(), 1);
}

TEST(InterleavedRows, OnlyTheLastBlockIsShortAndItEndsItsCall) {
  const InterleavedRows plan(10, 4, 2);  // blocks of 4, 4, 2 rows
  EXPECT_EQ(plan.blocks(), 3);
  EXPECT_EQ(plan.BlockRows(0), 4);
  EXPECT_EQ(plan.BlockRows(2), 2);
  EXPECT_EQ(plan.CallRows(0), 6);  // blocks 0 and 2
  EXPECT_EQ(plan.CallRows(1), 4);
  EXPECT_EQ(plan.RequestRow(0, 4), 8);  // call 0's second block starts at row 8
  EXPECT_EQ(plan.RequestRow(1, 3), 7);
}

}  // namespace
}  // namespace detlogp::client
