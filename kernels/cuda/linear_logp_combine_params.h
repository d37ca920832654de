// Launch parameters of the combine kernel (linear_logp_combine_kernel.cuh),
// apart from the kernel so that host code can fill them.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_PARAMS_H_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_PARAMS_H_

#include <cstdint>

namespace detlogp::kernels::cuda::combine {

struct CombineParams {
  const float* split_lse;     // [rows][num_splits]
  const float* split_mean_z;  // [rows][num_splits] or null: no entropy
  const float* split_top_z;   // [rows][num_splits][top_k] or null
  const int32_t* split_top_id;
  int32_t num_splits;
  int32_t rows;
  int32_t top_k;
  float* logprobs;  // z[target] on entry
  float* lse;
  // When either is set, a row whose target lies outside [0, vocab_size)
  // (no split wrote its z) gets a NaN logprob.
  const int32_t* targets;
  const int64_t* targets64;
  int32_t vocab_size;
  float* entropy;    // or null
  int32_t* top_ids;  // [rows][top_k] or null
  float* top_logprobs;
};

}  // namespace detlogp::kernels::cuda::combine

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_PARAMS_H_
