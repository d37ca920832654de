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
          const RowBlockAndSplit rs =
              DecodeItem(item, row_blocks, splits, group);
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
  struct Case {
    int item, row_block, split;
  };
  for (const Case& c :
       {Case{0, 0, 0}, Case{7, 7, 0}, Case{8, 0, 1}, Case{24, 8, 0},
        Case{48 + 5, 17, 1}}) {  // last group: 16 + 5 % 4
    const RowBlockAndSplit rs = DecodeItem(c.item, 20, 3, 8);
    EXPECT_EQ(rs.row_block, c.row_block) << "item " << c.item;
    EXPECT_EQ(rs.split, c.split) << "item " << c.item;
  }
}

}  // namespace
}  // namespace detlogp::kernels
