// Contiguous-range parallel loops on short-lived threads, for work whose
// ranges write disjoint outputs (so the thread count never changes bits).
#ifndef DETLOGP_KERNELS_PARALLEL_FOR_H_
#define DETLOGP_KERNELS_PARALLEL_FOR_H_

#include <cstdint>
#include <functional>

namespace detlogp::kernels {

// Runs fn(begin, end) over [0, n) split into contiguous ranges on up to
// num_threads threads (0: hardware concurrency). Ranges never share outputs,
// so thread count never changes bits.
void ParallelForRanges(int64_t n, int num_threads,
                       const std::function<void(int64_t, int64_t)>& fn);

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_PARALLEL_FOR_H_
