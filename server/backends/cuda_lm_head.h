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
            std::vector<std::unique_ptr<CudaLmHead>> heads,
            int64_t padded_vocab_size = 0, bool has_bias = false)
      : LogpModel(hidden_size, vocab_size),
        heads_(std::move(heads)),
        padded_vocab_size_(padded_vocab_size),
        has_bias_(has_bias) {}
  const std::vector<std::unique_ptr<CudaLmHead>>& heads() const {
    return heads_;
  }
  // Read back from the GPUs (cudaMemcpy, a chunk at a time), each row from
  // a head that holds it; UNIMPLEMENTED when no head holds some row (the
  // padding rows a vocabulary-parallel split leaves out) or the shape was
  // not given.
  absl::Status ReadWeights(int64_t offset, int64_t size,
                           char* out) const override;

 private:
  std::vector<std::unique_ptr<CudaLmHead>> heads_;
  const int64_t padded_vocab_size_;
  const bool has_bias_;
};

// Uploads the rows of splits [first_split, end_split) of `weights` (all rows
// when end_split is 0) to `device` and builds `kernel` over them.
absl::StatusOr<std::unique_ptr<CudaLmHead>> UploadLmHead(
    const LmHeadWeights& weights, int device, kernels::cuda::KernelKind kernel,
    int32_t first_split = 0, int32_t end_split = 0);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CUDA_LM_HEAD_H_
