// The vocabulary split policy: the one place that decides how the vocabulary
// is cut into splits for every backend (CPU and CUDA).
//
// The determinism contract rests on this file. The number of splits and their
// boundaries are a function of the real vocabulary size V alone; never of the
// row count, the thread count, the device or its multiprocessor count. Each
// split yields a partial (max, sum-exp) state per row; partials are combined
// in ascending split order (see softmax_partial.h).
//
// Shape of the policy: the vocabulary is cut into granules of
// `kSplitGranule` rows, and the granules are spread as evenly as possible over
// min(kMaxVocabSplits, granules) contiguous splits. 132 splits match the 132
// multiprocessors of the H100/H200 SXM parts this service runs on: at N = 1
// every multiprocessor streams 1/132 of the weight (with 128, four idled and
// the largest split was 19 granules instead of 18), and at large N the
// (128-row block, split) work items of the CUDA kernel fill whole waves
// whenever N is a multiple of 128 (with 128 splits, N = 2048 needed 15.5
// waves, i.e. 16). A row's per-split state is stored as the split's
// logsumexp (4 bytes) by the CUDA kernel: 132 x 4 bytes, well under the
// 1 KiB per-row workspace budget.
//
// Changing any constant here changes bits: bump kSplitPolicyName with it.
#ifndef DETLOGP_KERNELS_SPLIT_POLICY_H_
#define DETLOGP_KERNELS_SPLIT_POLICY_H_

#include <cstdint>

#include "kernels/host_device.h"

namespace detlogp::kernels {

inline constexpr int64_t kSplitGranule = 64;
inline constexpr int32_t kMaxVocabSplits = 132;
inline constexpr const char kSplitPolicyName[] = "v-only/granule64/max132/v2";

// A contiguous half-open range of vocabulary rows [begin, end).
struct VocabRange {
  int64_t begin;
  int64_t end;
};

// Number of splits for a real vocabulary of `vocab_size` rows (>= 1).
DETLOGP_HOST_DEVICE inline int32_t NumVocabSplits(int64_t vocab_size) {
  const int64_t granules = (vocab_size + kSplitGranule - 1) / kSplitGranule;
  return static_cast<int32_t>(granules < kMaxVocabSplits ? granules
                                                         : kMaxVocabSplits);
}

// Range of split `split` (0 <= split < NumVocabSplits(vocab_size)). Every
// boundary except the last is a multiple of kSplitGranule.
DETLOGP_HOST_DEVICE inline VocabRange VocabSplitRange(int64_t vocab_size,
                                                      int32_t split) {
  const int64_t granules = (vocab_size + kSplitGranule - 1) / kSplitGranule;
  const int64_t splits = NumVocabSplits(vocab_size);
  const int64_t first = granules * split / splits;
  const int64_t last = granules * (split + 1) / splits;
  const int64_t end = last * kSplitGranule;
  return VocabRange{first * kSplitGranule, end < vocab_size ? end : vocab_size};
}

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_SPLIT_POLICY_H_
