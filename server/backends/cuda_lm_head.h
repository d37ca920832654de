// The lm_head (or a contiguous share of its vocabulary splits) on one GPU,
// with the fused kernel built over it. Used whole by the replicated CUDA
// backend and in shares by vocabulary parallelism.
#ifndef DETLOGP_SERVER_BACKENDS_CUDA_LM_HEAD_H_
#define DETLOGP_SERVER_BACKENDS_CUDA_LM_HEAD_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/linear_logp_cuda.h"
#include "server/backends/backend.h"
#include "server/backends/cuda_buffers.h"
#include "server/models/lm_head_weights.h"

namespace detlogp::server {

struct CudaLmHead {
  int device = 0;
  // Splits [first_split, end_split) of the policy; end_split == 0: all of
  // them (the whole weight, padding rows included).
  int32_t first_split = 0;
  int32_t end_split = 0;
  // Weight rows held: [first_row, end_row).
  int64_t first_row = 0;
  int64_t end_row = 0;
  DeviceBuffer weight;
  DeviceBuffer bias;
  // Declared after the buffers it points into, so it is destroyed first.
  std::unique_ptr<kernels::cuda::LinearLogpCuda> kernel;
};

// A model on the CUDA backend's GPUs, one head per GPU in the backend's
// device order: the whole lm_head on each (replicated), or a contiguous
// share of its splits on each (vocabulary-parallel).
class CudaModel final : public LogpModel {
 public:
  CudaModel(int64_t hidden_size, int64_t vocab_size,
            std::vector<std::unique_ptr<CudaLmHead>> heads)
      : LogpModel(hidden_size, vocab_size), heads_(std::move(heads)) {}
  const std::vector<std::unique_ptr<CudaLmHead>>& heads() const {
    return heads_;
  }

 private:
  std::vector<std::unique_ptr<CudaLmHead>> heads_;
};

// Uploads the rows of splits [first_split, end_split) of `weights` (all rows
// when end_split is 0) to `device` and builds `kernel` over them.
absl::StatusOr<std::unique_ptr<CudaLmHead>> UploadLmHead(
    const LmHeadWeights& weights, int device, kernels::cuda::KernelKind kernel,
    int32_t first_split = 0, int32_t end_split = 0);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CUDA_LM_HEAD_H_
