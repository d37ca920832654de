#include "kernels/item_order.h"

#include <vector>

#include "gtest/gtest.h"

namespace detlogp::kernels {
namespace {

// Every (row block, split) is exactly one item, whatever the group.
TEST(ItemOrder, EveryRowBlockAndSplitOnce) {
  for (int row_blocks = 1; row_blocks <= 40; ++row_blocks) {
    for (int splits : {1, 2, 7, 132}) {
      for (int group : {1, 3, 8, 16, 32, 64}) {
        std::vector<int> seen(row_blocks * splits, 0);
        for (int item = 0; item < row_blocks * splits; ++item) {
          const RowBlockAndSplit rs = DecodeItem(item, row_blocks, splits, group);
          ASSERT_GE(rs.row_block, 0);
          ASSERT_LT(rs.row_block, row_blocks);
          ASSERT_GE(rs.split, 0);
          ASSERT_LT(rs.split, splits);
          ++seen[rs.row_block * splits + rs.split];
        }
        for (int count : seen) {
          ASSERT_EQ(count, 1) << row_blocks << " row blocks, " << splits
                              << " splits, group " << group;
        }
      }
    }
  }
}

// Inside a group the row block runs fastest; groups follow each other.
TEST(ItemOrder, RowBlocksFastestInsideAGroup) {
  // 20 row blocks, 3 splits, groups of 8, 8 and 4 row blocks.
  const RowBlockAndSplit first = DecodeItem(0, 20, 3, 8);
  EXPECT_EQ(first.row_block, 0);
  EXPECT_EQ(first.split, 0);
  const RowBlockAndSplit eighth = DecodeItem(7, 20, 3, 8);
  EXPECT_EQ(eighth.row_block, 7);
  EXPECT_EQ(eighth.split, 0);
  const RowBlockAndSplit ninth = DecodeItem(8, 20, 3, 8);
  EXPECT_EQ(ninth.row_block, 0);
  EXPECT_EQ(ninth.split, 1);
  const RowBlockAndSplit second_group = DecodeItem(24, 20, 3, 8);
  EXPECT_EQ(second_group.row_block, 8);
  EXPECT_EQ(second_group.split, 0);
  const RowBlockAndSplit last_group = DecodeItem(48 + 5, 20, 3, 8);
  EXPECT_EQ(last_group.row_block, 17);  // 4 row blocks: 16 + 5 % 4
  EXPECT_EQ(last_group.split, 1);
}

}  // namespace
}  // namespace detlogp::kernels
