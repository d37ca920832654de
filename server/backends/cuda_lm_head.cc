#include "server/backends/cuda_lm_head.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "kernels/parallel_for.h"
#include "kernels/split_policy.h"

namespace detlogp::server {
namespace {

// Host to device through two pinned staging buffers: a copy from pageable
// memory runs at a fraction of the link's speed, and pinning the whole
// source costs more than staging it.
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  constexpr size_t kStageBytes = 32 << 20;
  if (bytes <= kStageBytes) {
    return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice),
                      "upload weights");
  }
  PinnedBuffer stage[2];
  for (PinnedBuffer& buffer : stage) {
    if (absl::Status s = buffer.Allocate(kStageBytes, "cudaHostAlloc"); !s.ok())
      return s;
  }
  cudaStream_t stream = nullptr;
  DETLOGP_RETURN_IF_CUDA_ERROR(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
      "cudaStreamCreate");
  cudaEvent_t done[2] = {nullptr, nullptr};
  absl::Status status;
  for (cudaEvent_t& event : done) {
    if (status.ok()) {
      status =
          CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                     "cudaEventCreate");
    }
  }
  for (size_t offset = 0, i = 0; status.ok() && offset < bytes;
       offset += kStageBytes, ++i) {
    const size_t size = std::min(kStageBytes, bytes - offset);
    PinnedBuffer& buffer = stage[i % 2];
    // The copy that last read this buffer must be done before it is refilled.
    if (i >= 2)
      status = CudaStatus(cudaEventSynchronize(done[i % 2]), "staged upload");
    if (!status.ok()) break;
    // One thread copies ~5 GB/s out of a cold host buffer; eight keep the
    // link busy.
    kernels::ParallelForRanges(8, 8, [&](int64_t first, int64_t last) {
      const size_t begin = size * first / 8, end = size * last / 8;
      std::memcpy(buffer.as<char>() + begin,
                  static_cast<const char*>(src) + offset + begin, end - begin);
    });
    status = CudaStatus(
        cudaMemcpyAsync(static_cast<char*>(dst) + offset, buffer.as<void>(),
                        size, cudaMemcpyHostToDevice, stream),
        "upload weights");
    if (status.ok()) {
      status =
          CudaStatus(cudaEventRecord(done[i % 2], stream), "cudaEventRecord");
    }
  }
  // Also after a failure: no copy may still read the staging when it is freed.
  const absl::Status synced =
      CudaStatus(cudaStreamSynchronize(stream), "staged upload");
  for (cudaEvent_t event : done) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  cudaStreamDestroy(stream);
  return status.ok() ? synced : status;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaLmHead>> UploadLmHead(
    const LmHeadWeights& weights, int device,
    kernels::cuda::KernelKind kernel_kind, int32_t first_split,
    int32_t end_split) {
  auto head = std::make_unique<CudaLmHead>();
  head->device = device;
  head->first_split = first_split;
  head->end_split = end_split;
  head->end_row = weights.padded_vocab_size;
  if (end_split > 0) {
    head->first_row =
        kernels::VocabSplitRange(weights.vocab_size, first_split).begin;
    head->end_row =
        kernels::VocabSplitRange(weights.vocab_size, end_split - 1).end;
  }
  const int64_t rows = head->end_row - head->first_row;
  DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
  const size_t weight_bytes = rows * weights.hidden_size * sizeof(uint16_t);
  if (absl::Status s = head->weight.Allocate(weight_bytes, "weights");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CopyToDevice(
          head->weight.as<void>(),
          weights.weight.data() + head->first_row * weights.hidden_size,
          weight_bytes);
      !s.ok()) {
    return s;
  }
  if (!weights.bias.empty()) {
    if (absl::Status s = head->bias.Allocate(rows * sizeof(float), "bias");
        !s.ok()) {
      return s;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpy(head->bias.as<void>(), weights.bias.data() + head->first_row,
                   rows * sizeof(float), cudaMemcpyHostToDevice),
        "upload bias");
  }
  kernels::cuda::LinearLogpCuda::Options options;
  options.device = device;
  options.kernel = kernel_kind;
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
