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
// every row block of a split together, docs/perf.md).
inline constexpr int kDefaultRowGroup = 8;
// The top-k variants': 32 row blocks, so that from N = 2048 on 4-8 of a
// row's splits run side by side instead of 16.5. Measured on the H200
// (docs/perf.md, session 10): top-20 over logp-only 24.3 -> 22.1 % at
// N = 2048, 24.2 -> 19.9 % at 4096, 25.9 -> 23.2 % at 8192, equal at 1024.
inline constexpr int kDefaultTopKRowGroup = 32;

struct RowBlockAndSplit {
  int row_block;
  int split;
};

// Item `item` of num_row_blocks * num_splits, row blocks taken `group` at a
// time (group >= 1; the last group may hold fewer).
DETLOGP_HOST_DEVICE inline RowBlockAndSplit DecodeItem(int item, int num_row_blocks,
                                                       int num_splits, int group) {
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
