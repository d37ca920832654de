#include "client/cuda_runtime_loader.h"

#include <dlfcn.h>

#include <cstddef>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace detlogp::client {
namespace {

// The runtime's values this file relies on (driver_types.h); the API keeps
// them fixed across versions.
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorMemoryAllocation = 2;
constexpr int kCudaErrorInsufficientDriver = 35;
constexpr int kCudaErrorNoDevice = 100;
constexpr int kCudaErrorInvalidDevice = 101;
constexpr int kCudaMemoryTypeDevice = 2;
constexpr int kCudaMemoryTypeManaged = 3;

// cudaPointerAttributes' leading fields; the tail leaves room for the
// fields a newer runtime adds (CUDA 13 has 8 reserved longs).
struct PointerAttributes {
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
  long reserved[64];
};

}  // namespace

struct CudaRuntime::Functions {
  int (*malloc)(void**, size_t) = nullptr;
  int (*free)(void*) = nullptr;
  int (*ipc_get_mem_handle)(void*, void*) = nullptr;
  int (*memcpy_async)(void*, const void*, size_t, int, void*) = nullptr;
  int (*stream_synchronize)(void*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*get_device)(int*) = nullptr;
  int (*pointer_get_attributes)(PointerAttributes*, const void*) = nullptr;
  const char* (*get_error_string)(int) = nullptr;
};

namespace {

// Resolves `name` into `function`; false when the library lacks it.
template <typename F>
bool Resolve(void* handle, const char* name, F* function) {
  *function = reinterpret_cast<F>(dlsym(handle, name));
  return *function != nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaRuntime>> CudaRuntime::Load(
    const Options& options) {
  std::vector<std::string> failures;
  for (const std::string& library : options.libraries) {
    // RTLD_NODELETE: dlclose never unloads it; the runtime's contexts and
    // exit handlers outlive any one object (CUDA does not support unloading
    // its runtime while the process may still use it).
    void* handle =
        dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (handle == nullptr) {
      const char* why = dlerror();
      failures.push_back(why != nullptr ? why : library + ": not loaded");
      continue;
    }
    auto functions = std::make_unique<Functions>();
    const char* missing = nullptr;
    auto need = [&](const char* name, auto* function) {
      if (missing == nullptr && !Resolve(handle, name, function)) {
        missing = name;
      }
    };
    need("cudaMalloc", &functions->malloc);
    need("cudaFree", &functions->free);
    need("cudaIpcGetMemHandle", &functions->ipc_get_mem_handle);
    need("cudaMemcpyAsync", &functions->memcpy_async);
    need("cudaStreamSynchronize", &functions->stream_synchronize);
    need("cudaSetDevice", &functions->set_device);
    need("cudaGetDevice", &functions->get_device);
    need("cudaPointerGetAttributes", &functions->pointer_get_attributes);
    need("cudaGetErrorString", &functions->get_error_string);
    if (missing != nullptr) {
      failures.push_back(absl::StrCat(library, ": no ", missing));
      dlclose(handle);
      continue;
    }
    return std::unique_ptr<CudaRuntime>(
        new CudaRuntime(handle, library, std::move(functions)));
  }
  if (failures.empty()) failures.push_back("no library named");
  return absl::FailedPreconditionError(absl::StrCat(
      "no CUDA runtime could be loaded (", absl::StrJoin(failures, "; "), ")"));
}

CudaRuntime::CudaRuntime(void* handle, std::string library,
                         std::unique_ptr<Functions> functions)
    : handle_(handle),
      library_(std::move(library)),
      functions_(std::move(functions)) {}

CudaRuntime::~CudaRuntime() { dlclose(handle_); }

absl::Status CudaRuntime::Error(int error, const std::string& what) const {
  const char* words = functions_->get_error_string(error);
  const std::string message = absl::StrCat(
      what, ": ", words != nullptr ? words : "unknown error", " (", error, ")");
  switch (error) {
    case kCudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case kCudaErrorInsufficientDriver:
    case kCudaErrorNoDevice:
      return absl::FailedPreconditionError(message);
    case kCudaErrorInvalidDevice:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<int> CudaRuntime::UseDevice(int device) const {
  int previous = 0;
  if (int e = functions_->get_device(&previous); e != kCudaSuccess) {
    return Error(e, "cudaGetDevice");
  }
  if (previous != device) {
    if (int e = functions_->set_device(device); e != kCudaSuccess) {
      return Error(e, absl::StrCat("cudaSetDevice(", device, ")"));
    }
  }
  return previous;
}

void CudaRuntime::RestoreDevice(int previous) const {
  int current = previous;
  functions_->get_device(&current);
  if (current != previous) functions_->set_device(previous);
}

absl::StatusOr<void*> CudaRuntime::Malloc(int device, int64_t bytes) const {
  auto previous = UseDevice(device);
  if (!previous.ok()) return previous.status();
  void* data = nullptr;
  const int e = functions_->malloc(&data, static_cast<size_t>(bytes));
  RestoreDevice(*previous);
  if (e != kCudaSuccess) {
    return Error(
        e, absl::StrCat("cudaMalloc(", bytes, " bytes on cuda:", device, ")"));
  }
  return data;
}

absl::Status CudaRuntime::Free(int device, void* data) const {
  auto previous = UseDevice(device);
  if (!previous.ok()) return previous.status();
  const int e = functions_->free(data);
  RestoreDevice(*previous);
  if (e != kCudaSuccess) {
    return Error(e, absl::StrCat("cudaFree on cuda:", device));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CudaRuntime::IpcMemHandle(int device,
                                                      void* data) const {
  auto previous = UseDevice(device);
  if (!previous.ok()) return previous.status();
  std::string handle(kIpcHandleBytes, '\0');
  const int e = functions_->ipc_get_mem_handle(handle.data(), data);
  RestoreDevice(*previous);
  if (e != kCudaSuccess) {
    return Error(e, absl::StrCat("cudaIpcGetMemHandle on cuda:", device));
  }
  return handle;
}

absl::Status CudaRuntime::Copy(void* to, const void* from, int64_t bytes,
                               CudaCopy kind, int device, void* stream) const {
  auto previous = UseDevice(device);
  if (!previous.ok()) return previous.status();
  int e = functions_->memcpy_async(to, from, static_cast<size_t>(bytes),
                                   static_cast<int>(kind), stream);
  const char* what = "cudaMemcpyAsync";
  if (e == kCudaSuccess) {
    e = functions_->stream_synchronize(stream);
    what = "cudaStreamSynchronize";
  }
  RestoreDevice(*previous);
  if (e != kCudaSuccess) {
    return Error(
        e, absl::StrCat(what, " (", bytes, " bytes on cuda:", device, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaRuntime::DeviceOf(const void* data) const {
  PointerAttributes attributes;
  std::memset(&attributes, 0, sizeof(attributes));
  if (int e = functions_->pointer_get_attributes(&attributes, data);
      e != kCudaSuccess) {
    return Error(e, "cudaPointerGetAttributes");
  }
  if (attributes.type != kCudaMemoryTypeDevice &&
      attributes.type != kCudaMemoryTypeManaged) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not device memory (cudaPointerGetAttributes: memory type ",
        attributes.type, ")"));
  }
  return attributes.device;
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> DeviceMemory::Allocate(
    const CudaRuntime* runtime, int device, int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device memory: ", bytes, " bytes must be positive"));
  }
  auto data = runtime->Malloc(device, bytes);
  if (!data.ok()) return data.status();
  return std::unique_ptr<DeviceMemory>(
      new DeviceMemory(runtime, device, *data, bytes));
}

DeviceMemory::~DeviceMemory() {
  // A failure here (the process exiting, the device reset) leaves nothing
  // the caller could act on.
  runtime_->Free(device_, data_).IgnoreError();
}

}  // namespace detlogp::client
