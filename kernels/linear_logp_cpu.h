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
//
// Extras (rows.entropy, rows.top_k), fused into the same grid: each split
// also accumulates sum of exp(z - max) * z with the softmax's own rescaling
// and keeps its k best (z, id) in RanksBefore order; the fold combines the
// entropy sums in ascending split order (CombineEntropySums) and merges the
// split lists (a total order, so the merged list is order-independent).
// They are per-row quantities, so a row's bits depend only on that row, and
// computing them leaves logprobs and lse bit for bit as without them.
#ifndef DETLOGP_KERNELS_LINEAR_LOGP_CPU_H_
#define DETLOGP_KERNELS_LINEAR_LOGP_CPU_H_

#include "absl/status/status.h"
#include "kernels/lm_head.h"
#include "kernels/thread_pool.h"

namespace detlogp::kernels {

// Entropy and top-k first appeared under this version without changing any
// logprob or lse bit, so the key did not need to change; any later change to
// the bits of any output (extras included) must bump it.
inline constexpr char kCpuKernelVersion[] = "cpu-lanes16-v1";
// The ISA the kernels are compiled for (.bazelrc pins it): part of the
// determinism key (server/backends/cpu_backend.cc, kernels/capi).
inline constexpr char kCpuInstructionSet[] = "x86-64-v3/no-contract";

// Checks the views' shapes and pointers (not the row values).
absl::Status ValidateLinearLogpViews(const LmHeadView& head,
                                     const LogpRowsView& rows);

// Computes rows.logprobs and rows.lse, and rows.entropy when it is not null
// and rows.top_ids / rows.top_logprobs ([rows, top_k], each row in
// descending z, ties to the lower id; log-probs are z - lse) when
// rows.top_k > 0. Padding rows (>= vocab_size) are never candidates.
// `pool` may be null (single thread).
absl::Status ComputeLinearLogpCpu(const LmHeadView& head,
                                  const LogpRowsView& rows, ThreadPool* pool);

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_LINEAR_LOGP_CPU_H_
