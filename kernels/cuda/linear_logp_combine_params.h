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
  // The speculative floors' reruns (linear_logp_floor_kernel.cuh), top-k
  // only. mark_blocks set: a row whose merged list comes out short marks
  // its row block (mark_blocks[r / block_rows]) and the count
  // (mark_blocks[row_blocks]), and clears its screen in top_screen.
  // only_blocks set: a rerun pass, rows of unmarked blocks are left alone.
  int32_t* mark_blocks;
  uint32_t* top_screen;
  const int32_t* only_blocks;
  int32_t block_rows;
  int32_t row_blocks;
};

}  // namespace detlogp::kernels::cuda::combine

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_PARAMS_H_
