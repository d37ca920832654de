// The CUDA runtime, loaded when a program first needs it (dlopen), so that
// the client library and detlogp_cli build and run on machines without CUDA.
//
//   auto cuda = CudaRuntime::Load({});  // libcudart.so.13, else libcudart.so
//   if (!cuda.ok()) ...;                // FAILED_PRECONDITION: none loads
//   auto buffer = DeviceMemory::Allocate(cuda->get(), /*device=*/0, bytes);
//   (*cuda)->Copy((*buffer)->data(), host, bytes, CudaCopy::kHostToDevice,
//                 /*device=*/0, /*stream=*/nullptr);
//
// Only the few functions the client calls are resolved. Each call that takes
// a device makes it current for the call and restores the caller's current
// device after. A CudaRuntime holds no mutable state: one object may be used
// from many threads, and every object is independent. Once loaded, the
// library stays in the process (RTLD_NODELETE).
#ifndef DETLOGP_CLIENT_CUDA_RUNTIME_LOADER_H_
#define DETLOGP_CLIENT_CUDA_RUNTIME_LOADER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace detlogp::client {

// cudaMemcpyKind's values.
enum class CudaCopy : int {
  kHostToDevice = 1,
  kDeviceToHost = 2,
  kDeviceToDevice = 3,
};

class CudaRuntime {
 public:
  struct Options {
    // Tried in order; the first that loads with every function is used.
    std::vector<std::string> libraries = {"libcudart.so.13", "libcudart.so"};
  };
  // cudaIpcMemHandle_t's size.
  static constexpr int kIpcHandleBytes = 64;

  // FAILED_PRECONDITION naming every library tried when none loads.
  static absl::StatusOr<std::unique_ptr<CudaRuntime>> Load(
      const Options& options);
  ~CudaRuntime();
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  // The file that loaded.
  const std::string& library() const { return library_; }

  absl::StatusOr<void*> Malloc(int device, int64_t bytes) const;
  absl::Status Free(int device, void* data) const;
  // The 64 raw bytes of the allocation's cudaIpcMemHandle_t (`data` must be
  // an allocation's base for the handle to name it from byte 0).
  absl::StatusOr<std::string> IpcMemHandle(int device, void* data) const;
  // cudaMemcpyAsync on `stream` (a cudaStream_t; null: the legacy default
  // stream), then cudaStreamSynchronize of that stream: the bytes are in
  // place when it returns.
  absl::Status Copy(void* to, const void* from, int64_t bytes, CudaCopy kind,
                    int device, void* stream) const;
  // The device that holds `data`: INVALID_ARGUMENT when it is not device
  // (or managed) memory.
  absl::StatusOr<int> DeviceOf(const void* data) const;

 private:
  struct Functions;
  CudaRuntime(void* handle, std::string library,
              std::unique_ptr<Functions> functions);
  // `what` failed with `error`: the status, with CUDA's words for it.
  absl::Status Error(int error, const std::string& what) const;
  // Makes `device` current; the returned status is the caller's device to
  // restore (or the failure).
  absl::StatusOr<int> UseDevice(int device) const;
  void RestoreDevice(int previous) const;

  void* const handle_;
  const std::string library_;
  const std::unique_ptr<Functions> functions_;
};

// Device memory from CudaRuntime::Malloc, freed on destruction. The runtime
// must outlive it.
class DeviceMemory {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceMemory>> Allocate(
      const CudaRuntime* runtime, int device, int64_t bytes);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  DeviceMemory(const CudaRuntime* runtime, int device, void* data,
               int64_t bytes)
      : runtime_(runtime), device_(device), data_(data), bytes_(bytes) {}
  const CudaRuntime* const runtime_;
  const int device_;
  void* const data_;
  const int64_t bytes_;
};

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_CUDA_RUNTIME_LOADER_H_
