// Vocabulary-parallel serving for an lm_head too large for one GPU: GPU g
// holds the weight rows of a contiguous range of the V-only splits, computes
// those splits' partial states for every row of a batch, and the partials of
// all GPUs are folded on the first GPU in ascending split order with the same
// combine kernel as a single GPU -- so the answer is bit-identical to the
// single-GPU answer (and carries the same determinism key).
#ifndef DETLOGP_SERVER_CUDA_VOCAB_PARALLEL_H_
#define DETLOGP_SERVER_CUDA_VOCAB_PARALLEL_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/linear_logp_cuda.h"
#include "server/backend.h"
#include "server/cuda_buffers.h"

namespace detlogp::server {

// One GPU's share of the vocabulary.
struct VocabShard {
  int device = 0;
  int32_t first_split = 0;  // [first_split, end_split) of the policy
  int32_t end_split = 0;
  int64_t first_row = 0;    // [first_row, end_row) of the weight
  int64_t end_row = 0;
  DeviceBuffer weight;
  DeviceBuffer bias;
  // Declared after the buffers it points into, so it is destroyed first.
  std::unique_ptr<kernels::cuda::LinearLogpCuda> kernel;
};

// Cuts the splits of `weights` evenly over `devices` (in order) and uploads
// each device's rows.
absl::StatusOr<std::vector<std::unique_ptr<VocabShard>>> UploadVocabShards(
    const LmHeadWeights& weights, const std::vector<int>& devices);

// An executor that runs every batch on all shards, then combines on the
// first shard's GPU. `shards` outlive it.
absl::StatusOr<std::unique_ptr<LogpExecutor>> NewVocabParallelExecutor(
    const std::vector<std::unique_ptr<VocabShard>>& shards, int64_t hidden_size,
    int64_t vocab_size, int64_t capacity);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_CUDA_VOCAB_PARALLEL_H_
