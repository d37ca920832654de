#include "server/backends/cuda_lm_head.h"

#include <cuda_runtime_api.h>

#include "kernels/split_policy.h"

namespace detlogp::server {

absl::StatusOr<std::unique_ptr<CudaLmHead>> UploadLmHead(
    const LmHeadWeights& weights, int device, int32_t first_split,
    int32_t end_split) {
  auto head = std::make_unique<CudaLmHead>();
  head->device = device;
  head->first_split = first_split;
  head->end_split = end_split;
  head->end_row = weights.padded_vocab_size;
  if (end_split > 0) {
    head->first_row = kernels::VocabSplitRange(weights.vocab_size, first_split).begin;
    head->end_row = kernels::VocabSplitRange(weights.vocab_size, end_split - 1).end;
  }
  const int64_t rows = head->end_row - head->first_row;
  DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
  const size_t weight_bytes = rows * weights.hidden_size * sizeof(uint16_t);
  if (absl::Status s = head->weight.Allocate(weight_bytes, "weights"); !s.ok()) {
    return s;
  }
  DETLOGP_RETURN_IF_CUDA_ERROR(
      cudaMemcpy(head->weight.as<void>(),
                 weights.weight.data() + head->first_row * weights.hidden_size,
                 weight_bytes, cudaMemcpyHostToDevice),
      "upload weights");
  if (!weights.bias.empty()) {
    if (absl::Status s = head->bias.Allocate(rows * sizeof(float), "bias"); !s.ok()) {
      return s;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpy(head->bias.as<void>(), weights.bias.data() + head->first_row,
                   rows * sizeof(float), cudaMemcpyHostToDevice),
        "upload bias");
  }
  kernels::cuda::LinearLogpCuda::Options options;
  options.device = device;
  options.weights.weight = head->weight.as<const __nv_bfloat16>();
  options.weights.bias =
      weights.bias.empty() ? nullptr : head->bias.as<const float>();
  options.weights.hidden_size = weights.hidden_size;
  options.weights.vocab_size = weights.vocab_size;
  options.weights.padded_vocab_size = rows;
  options.first_split = first_split;
  options.end_split = end_split;
  auto kernel = kernels::cuda::LinearLogpCuda::Create(options);
  if (!kernel.ok()) return kernel.status();
  head->kernel = *std::move(kernel);
  return head;
}

}  // namespace detlogp::server
