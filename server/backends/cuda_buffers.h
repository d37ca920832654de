// RAII owners of CUDA memory for the CUDA backends, and CUDA errors as
// absl::Status (out of memory is RESOURCE_EXHAUSTED, the rest INTERNAL).
#ifndef DETLOGP_SERVER_BACKENDS_CUDA_BUFFERS_H_
#define DETLOGP_SERVER_BACKENDS_CUDA_BUFFERS_H_

#include <cuda_runtime_api.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/backends/backend.h"

namespace detlogp::server {

inline absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const absl::StatusCode code = error == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code,
                      absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

#define DETLOGP_RETURN_IF_CUDA_ERROR(expr, what)                  \
  do {                                                            \
    if (absl::Status _s = CudaStatus((expr), (what)); !_s.ok()) { \
      return _s;                                                  \
    }                                                             \
  } while (false)

// CUDA memory freed on destruction: device memory (DeviceBuffer) or pinned
// host memory (PinnedBuffer, so copies run asynchronously at full PCIe
// speed).
template <cudaError_t (*Alloc)(void**, size_t), cudaError_t (*Free)(void*)>
class CudaBuffer {
 public:
  CudaBuffer() = default;
  ~CudaBuffer() {
    if (ptr_ != nullptr) Free(ptr_);
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  // Frees what it held, then allocates `bytes`.
  absl::Status Allocate(size_t bytes, const char* what) {
    if (ptr_ != nullptr) Free(std::exchange(ptr_, nullptr));
    bytes_ = 0;
    DETLOGP_RETURN_IF_CUDA_ERROR(Alloc(&ptr_, bytes == 0 ? 1 : bytes), what);
    bytes_ = bytes;
    return absl::OkStatus();
  }
  // Allocates when it holds fewer than `bytes`.
  absl::Status Reserve(size_t bytes, const char* what) {
    return bytes <= bytes_ && ptr_ != nullptr ? absl::OkStatus()
                                              : Allocate(bytes, what);
  }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

inline cudaError_t AllocateDevice(void** ptr, size_t bytes) {
  return cudaMalloc(ptr, bytes);
}
inline cudaError_t AllocatePinned(void** ptr, size_t bytes) {
  return cudaHostAlloc(ptr, bytes, cudaHostAllocDefault);
}
using DeviceBuffer = CudaBuffer<AllocateDevice, cudaFree>;
using PinnedBuffer = CudaBuffer<AllocatePinned, cudaFreeHost>;

// The CUDA executors' batch layout: inputs in one block
// [targets | temperatures | hidden] and outputs in [logprobs | lse], so a
// batch moves in one copy each way. `capacity` is even, which keeps the
// hidden rows 16-byte aligned.
struct BatchLayout {
  int64_t capacity = 0;

  size_t hidden_offset() const { return 2 * capacity * sizeof(float); }
  size_t input_bytes(int64_t hidden_size) const {
    return hidden_offset() + capacity * hidden_size * sizeof(uint16_t);
  }
  // Outputs: [logprobs | lse | entropy | top_logprobs | top_ids], the top
  // lists kernels::kMaxTopK wide per row (a batch uses [rows, top_k] of it).
  size_t output_bytes() const {
    return (3 + 2 * kernels::kMaxTopK) * capacity * sizeof(float);
  }

  // Views of an inputs block and an outputs block laid out as above.
  LogpStaging View(void* inputs, void* outputs) const {
    char* in = static_cast<char*>(inputs);
    float* out = static_cast<float*>(outputs);
    LogpStaging view;
    view.capacity = capacity;
    view.targets = reinterpret_cast<int32_t*>(in);
    view.temperatures = reinterpret_cast<float*>(in + capacity * sizeof(float));
    view.hidden = reinterpret_cast<uint16_t*>(in + hidden_offset());
    if (out != nullptr) {
      view.logprobs = out;
      view.lse = out + capacity;
      view.entropy = out + 2 * capacity;
      view.top_logprobs = out + 3 * capacity;
      view.top_ids =
          reinterpret_cast<int32_t*>(out + (3 + kernels::kMaxTopK) * capacity);
    }
    return view;
  }
};

// Copies a batch's outputs from the device block `device` (a View of the
// layout) to the host block: logprobs and lse always, entropy and the top
// lists ([rows, top_k] each) only when the batch asked for them.
inline absl::Status CopyOutputsToHost(const BatchLayout& layout,
                                      const LogpStaging& device,
                                      void* host_outputs, int64_t rows,
                                      const LogpExtras& extras,
                                      cudaStream_t stream) {
  const LogpStaging host = layout.View(nullptr, host_outputs);
  auto copy = [&](void* to, const void* from, size_t bytes) {
    return CudaStatus(
        cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToHost, stream),
        "copy results to host");
  };
  // logprobs and lse are adjacent: one copy of the block's first 2 columns.
  if (absl::Status s = copy(host.logprobs, device.logprobs,
                            2 * layout.capacity * sizeof(float));
      !s.ok()) {
    return s;
  }
  if (extras.entropy) {
    if (absl::Status s =
            copy(host.entropy, device.entropy, rows * sizeof(float));
        !s.ok()) {
      return s;
    }
  }
  if (extras.top_k > 0) {
    const size_t bytes = rows * extras.top_k * sizeof(float);
    if (absl::Status s = copy(host.top_logprobs, device.top_logprobs, bytes);
        !s.ok()) {
      return s;
    }
    return copy(host.top_ids, device.top_ids, bytes);
  }
  return absl::OkStatus();
}

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CUDA_BUFFERS_H_
