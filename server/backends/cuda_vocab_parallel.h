// Vocabulary-parallel serving for an lm_head too large for one GPU: GPU g
// holds the weight rows of a contiguous range of the V-only splits, computes
// those splits' partial states for every row of a batch, and the partials of
// all GPUs are folded on the first GPU in ascending split order with the same
// combine kernel as a single GPU -- so the answer is bit-identical to the
// single-GPU answer (and carries the same determinism key).
#ifndef DETLOGP_SERVER_BACKENDS_CUDA_VOCAB_PARALLEL_H_
#define DETLOGP_SERVER_BACKENDS_CUDA_VOCAB_PARALLEL_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"
#include "server/backends/cuda_lm_head.h"

namespace detlogp::server {

// Cuts the splits of `weights` evenly over `devices` (in order) and uploads
// each device's rows.
// Every shard runs `kernel` (the GPUs are of one kind, see
// cuda_device_selection.h); the fold runs that kernel's combine.
absl::StatusOr<std::vector<std::unique_ptr<CudaLmHead>>> UploadVocabShards(
    const LmHeadWeights& weights, const std::vector<int>& devices,
    kernels::cuda::KernelKind kernel);

// An executor that runs every batch on the shards of its CudaModel (one per
// device of `devices`, in order), then combines on the first device.
absl::StatusOr<std::unique_ptr<LogpExecutor>> NewVocabParallelExecutor(
    const std::vector<int>& devices, int64_t capacity);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CUDA_VOCAB_PARALLEL_H_
