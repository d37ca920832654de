// The CPU fused linear-logp kernel: logprob = z[target] - logsumexp(z) with
// z = (h . W[v] + b[v]) / temperature, without materialising [N, V] logits.
//
// Batch invariance: every row is computed by the same sequence of float
// operations whatever the batch holds:
//   * each dot product accumulates h[k] * W[v][k] into lane k % kDotLanes in
//     ascending k, then folds the lanes with a fixed pairwise tree;
//   * each vocabulary split (split_policy.h) runs an online softmax over its
//     rows in ascending v;
//   * split partials fold in ascending split order (softmax_partial.h).
// Threads split the (row block, split) grid; each cell writes its own partial,
// so the thread count changes only speed.
#ifndef DETLOGP_KERNELS_LINEAR_LOGP_CPU_H_
#define DETLOGP_KERNELS_LINEAR_LOGP_CPU_H_

#include "absl/status/status.h"
#include "kernels/lm_head.h"
#include "kernels/thread_pool.h"

namespace detlogp::kernels {

inline constexpr char kCpuKernelVersion[] = "cpu-lanes16-v1";
// The ISA the kernels are compiled for (.bazelrc pins it): part of the
// determinism key (server/backends/cpu_backend.cc, kernels/capi).
inline constexpr char kCpuInstructionSet[] = "x86-64-v3/no-contract";

// Checks the views' shapes and pointers (not the row values).
absl::Status ValidateLinearLogpViews(const LmHeadView& head,
                                     const LogpRowsView& rows);

// Computes rows.logprobs and rows.lse. `pool` may be null (single thread).
absl::Status ComputeLinearLogpCpu(const LmHeadView& head,
                                  const LogpRowsView& rows, ThreadPool* pool);

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_LINEAR_LOGP_CPU_H_
