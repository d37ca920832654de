// The fold of the split partials both linear-logp kernels write (v3's
// partial format: each split's logsumexp, and for the extras its entropy sum
// and top-k list), in ascending split order. Shared by the Hopper kernel
// (linear_logp_cuda.cu, sm_90a) and the portable kernel
// (linear_logp_portable.cu, sm_80..sm_90 + compute_80 PTX): each translation
// unit compiles its own copy for its own architectures (the kernel has
// internal linkage), so the fold a split kernel's partials go through is
// built exactly like the split kernel, and its bits are covered by the same
// determinism key (kernel version + instruction set).
// Build flags matter for bits: no --use_fast_math / -ftz / -prec-div changes
// (expf/logf).
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_KERNEL_CUH_

#include <cstdint>

#include "kernels/cuda/linear_logp_combine_params.h"
#include "kernels/lm_head.h"
#include "kernels/softmax_partial.h"

namespace detlogp::kernels::cuda::combine {

// Folds each row's split partials ({lse_s, 1}) in ascending split order with
// CombinePartials, starting from split 0, and finishes
// logprob = z[target] - lse; the entropy sums fold alongside with the same
// rescaling, and the per-split top-k lists merge into one sorted list. One
// thread per row: the fold order is fixed and independent of the launch
// shape.
static __global__ void CombineKernel(const __grid_constant__ CombineParams p) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.rows) return;
  const int64_t first = static_cast<int64_t>(r) * p.num_splits;
  const float* row = p.split_lse + first;
  SoftmaxPartial acc{row[0], 1.0f};
  float sum_exp_z = p.split_mean_z != nullptr ? p.split_mean_z[first] : 0.0f;
  for (int s = 1; s < p.num_splits; ++s) {
    const SoftmaxPartial next{row[s], 1.0f};
    if (p.split_mean_z != nullptr) {
      sum_exp_z = CombineEntropySums(
          EntropyPartial{acc, sum_exp_z},
          EntropyPartial{next, p.split_mean_z[first + s]},
          fmaxf(acc.max, next.max));
    }
    acc = CombinePartials(acc, next);
  }
  const float l = PartialLogSumExp(acc);
  p.lse[r] = l;
  float z_target = p.logprobs[r];
  if (p.targets != nullptr || p.targets64 != nullptr) {
    const int64_t t = p.targets != nullptr ? p.targets[r] : p.targets64[r];
    if (t < 0 || t >= p.vocab_size) z_target = NAN;
  }
  p.logprobs[r] = z_target - l;
  if (p.entropy != nullptr) p.entropy[r] = PartialEntropy(acc, sum_exp_z, l);
  if (p.top_ids == nullptr) return;
  // Insertion into a sorted list; the candidates' order does not matter (the
  // k best under a total order are one set).
  float best_z[::detlogp::kernels::kMaxTopK];
  int32_t best_id[::detlogp::kernels::kMaxTopK];
  int count = 0;
  const float* cand_z = p.split_top_z + first * p.top_k;
  const int32_t* cand_id = p.split_top_id + first * p.top_k;
  for (int s = 0; s < p.num_splits; ++s) {
    // Each split's list is sorted, empty entries last: once an entry does
    // not make the list, the rest of the split's do not either.
    for (int c = s * p.top_k; c < (s + 1) * p.top_k; ++c) {
      const float z = cand_z[c];
      const int32_t id = cand_id[c];
      if (id < 0) break;
      if (count == p.top_k &&
          !RanksBefore(z, id, best_z[count - 1], best_id[count - 1])) {
        break;
      }
      int i = count < p.top_k ? count++ : count - 1;
      for (; i > 0 && RanksBefore(z, id, best_z[i - 1], best_id[i - 1]); --i) {
        best_z[i] = best_z[i - 1];
        best_id[i] = best_id[i - 1];
      }
      best_z[i] = z;
      best_id[i] = id;
    }
  }
  for (int i = 0; i < p.top_k; ++i) {
    const int64_t out = static_cast<int64_t>(r) * p.top_k + i;
    p.top_ids[out] = i < count ? best_id[i] : -1;
    p.top_logprobs[out] = i < count ? best_z[i] - l : -INFINITY;
  }
}

}  // namespace detlogp::kernels::cuda::combine

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_KERNEL_CUH_
