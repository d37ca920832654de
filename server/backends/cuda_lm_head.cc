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

absl::Status CudaModel::ReadWeights(int64_t offset, int64_t size,
                                    char* out) const {
  if (padded_vocab_size_ <= 0) {
    return absl::UnimplementedError("the model's shape was not recorded");
  }
  // Every row must be held by some head.
  int64_t covered = 0;
  while (covered < padded_vocab_size_) {
    int64_t next = covered;
    for (const auto& head : heads_) {
      if (head->first_row <= covered && head->end_row > next) {
        next = head->end_row;
      }
    }
    if (next == covered) {
      return absl::UnimplementedError(absl::StrCat(
          "no GPU holds weight row ", covered, " (of ", padded_vocab_size_,
          "): a vocabulary-parallel split leaves the padding rows out"));
    }
    covered = next;
  }
  const int64_t row_bytes =
      hidden_size() * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t weight_bytes = padded_vocab_size_ * row_bytes;
  const int64_t total = weight_bytes + (has_bias_ ? padded_vocab_size_ * 4 : 0);
  if (offset < 0 || size < 0 || offset + size > total) {
    return absl::OutOfRangeError(
        absl::StrCat("bytes [", offset, ", ", offset + size, ") of ", total));
  }
  while (size > 0) {
    const bool in_weight = offset < weight_bytes;
    const int64_t element_bytes = in_weight ? row_bytes : 4;
    const int64_t local = in_weight ? offset : offset - weight_bytes;
    const int64_t row = local / element_bytes;
    const CudaLmHead* holder = nullptr;
    for (const auto& head : heads_) {
      if (head->first_row <= row && row < head->end_row) {
        holder = head.get();
        break;
      }
    }
    if (holder == nullptr) {
      return absl::InternalError(absl::StrCat("no GPU holds row ", row));
    }
    const int64_t end = holder->end_row * element_bytes;
    int64_t count = std::min(size, end - local);
    if (in_weight) count = std::min(count, weight_bytes - offset);
    const DeviceBuffer& buffer = in_weight ? holder->weight : holder->bias;
    const char* source =
        buffer.as<const char>() + (local - holder->first_row * element_bytes);
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(holder->device),
                                 "cudaSetDevice");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpy(out, source, count, cudaMemcpyDeviceToHost),
        "read weights back");
    out += count;
    offset += count;
    size -= count;
  }
  return absl::OkStatus();
}

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
