// RAII owners of CUDA memory for the CUDA backends, and CUDA errors as
// absl::Status (out of memory is RESOURCE_EXHAUSTED, the rest INTERNAL).
#ifndef DETLOGP_SERVER_CUDA_BUFFERS_H_
#define DETLOGP_SERVER_CUDA_BUFFERS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace detlogp::server {

inline absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const absl::StatusCode code = error == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

#define DETLOGP_RETURN_IF_CUDA_ERROR(expr, what)                  \
  do {                                                            \
    if (absl::Status _s = CudaStatus((expr), (what)); !_s.ok()) { \
      return _s;                                                  \
    }                                                             \
  } while (false)

// A device allocation freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  absl::Status Allocate(size_t bytes, const char* what) {
    return CudaStatus(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes), what);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

// Pinned host memory, so copies run asynchronously at full PCIe speed.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  absl::Status Allocate(size_t bytes, const char* what) {
    return CudaStatus(cudaHostAlloc(&ptr_, bytes == 0 ? 1 : bytes,
                                    cudaHostAllocDefault),
                      what);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_CUDA_BUFFERS_H_
