// The order in which the Hopper kernel's persistent CTAs take their items
// (and the portable kernel's CTAs run them, one per item), an item being
// one (row block, split): row blocks `group` at a time, the row block
// fastest inside a group. CTAs running at once then read the same
// splits' weights (shared in L2), and a row has about
// ctas / min(group, row blocks) of its splits side by side; the top-k
// variant's splits cut each other's insertions through shared screens, so
// fewer of a row's splits at once means tighter screens sooner. Item order
// never changes bits: each item's arithmetic and where it writes are its
// own, and the combine folds splits in ascending order whatever ran first.
#ifndef DETLOGP_KERNELS_ITEM_ORDER_H_
#define DETLOGP_KERNELS_ITEM_ORDER_H_

#include "kernels/host_device.h"

namespace detlogp::kernels {

// The row-block group of the logp-only and entropy variants: 8 row blocks
// (of 128 rows in the Hopper kernel, 256 in the portable one's large
// tiling, where a group's hidden rows, 16 MiB at H = 4096, stay in L2 while
// its splits go by: N = 8192 276 -> 293 TFLOP/s on the H200 against taking
// every row block of a split together; docs/kernels.md, "Item order").
inline constexpr int kDefaultRowGroup = 8;
// The top-k variants': the same 8. A group of 32 once paid (fewer of a
// row's splits side by side, so the shared screens tightened sooner: top-20
// 24.3 -> 22.1 % over logp-only at N = 2048); with the screens as they are
// now, 8 is as good or better: top-20 over logp-only, medians of 5-7 runs
// on the H200 with groups 8 / 32 / 64, +12.8 / 13.8 / 13.8 % at N = 2048,
// 13.6 / 14.9 / 14.7 at 3072, 13.8 / 13.8 / 12.7 at 4096, 14.3 / 15.0 /
// 14.6 at 8192.
inline constexpr int kDefaultTopKRowGroup = kDefaultRowGroup;

struct RowBlockAndSplit {
  int row_block;
  int split;
};

// Item `item` of num_row_blocks * num_splits, row blocks taken `group` at a
// time (group >= 1; the last group may hold fewer).
DETLOGP_HOST_DEVICE inline RowBlockAndSplit DecodeItem(int item,
                                                       int num_row_blocks,
                                                       int num_splits,
                                                       int group) {
  const int group_items = group * num_splits;
  const int g = item / group_items;
  const int r = item - g * group_items;
  const int left = num_row_blocks - g * group;
  const int in_group = left < group ? left : group;
  const int split = r / in_group;
  return {g * group + (r - split * in_group), split};
}

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_ITEM_ORDER_H_
