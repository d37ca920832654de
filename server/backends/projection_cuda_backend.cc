// The projection on the GPU: kernels/cuda/projection_cuda with pinned
// staging for X, a stream per executor, and Y copied from the device
// straight into the chunk buffers, which are pinned memory from the
// backend's pool. Same bits as the CPU backend.
#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cuda/kernel_kind.h"
#include "kernels/cuda/projection_cuda.h"
#include "kernels/projection.h"
#include "server/backends/caching_host_buffer_pool.h"
#include "server/backends/cuda_buffers.h"
#include "server/backends/projection_backend.h"

namespace detlogp::server {
namespace {

using kernels::kProjectionInDim;
using kernels::kProjectionOutDim;

constexpr size_t kRowBytes = kProjectionOutDim * sizeof(float);

// Memory the device can copy into asynchronously (cudaHostAlloc'd or
// registered), as opposed to pageable memory.
bool IsPinned(const void* ptr) {
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

// The backend's chunk buffers: pinned on `device`, recycled by the pool.
absl::StatusOr<std::shared_ptr<HostBufferPool>> NewPinnedPool(
    int device, int64_t max_cached_bytes) {
  CachingHostBufferPool::Options options;
  options.max_cached_bytes = max_cached_bytes;
  options.memory_name = "pinned";
  options.allocate = [device](size_t bytes) -> void* {
    void* data = nullptr;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaHostAlloc(&data, bytes, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return data;
  };
  // The releasing thread may be any of gRPC's, with no device set.
  options.free = [device](void* data) {
    cudaSetDevice(device);
    cudaFreeHost(data);
  };
  auto pool = CachingHostBufferPool::Create(options);
  if (!pool.ok()) return pool.status();
  return std::shared_ptr<HostBufferPool>(*std::move(pool));
}

class CudaProjectionExecutor final : public ProjectionExecutor {
 public:
  static absl::StatusOr<std::unique_ptr<CudaProjectionExecutor>> Create(
      const kernels::ProjectionCuda* kernel, int device, int64_t capacity) {
    std::unique_ptr<CudaProjectionExecutor> executor(
        new CudaProjectionExecutor(kernel, device, capacity));
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaStreamCreateWithFlags(&executor->stream_, cudaStreamNonBlocking),
        "cudaStreamCreate");
    const size_t x_bytes = capacity * kProjectionInDim * sizeof(float);
    const size_t y_bytes = capacity * kRowBytes;
    if (absl::Status s = executor->host_x_.Allocate(x_bytes, "cudaHostAlloc");
        !s.ok()) {
      return s;
    }
    for (auto [buffer, bytes] :
         {std::pair{&executor->x_, x_bytes}, {&executor->y_, y_bytes}}) {
      if (absl::Status s = buffer->Allocate(bytes, "cudaMalloc"); !s.ok())
        return s;
    }
    return executor;
  }

  ~CudaProjectionExecutor() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  ProjectionStaging staging() override {
    return {capacity_, host_x_.as<float>()};
  }

  // Each piece of Y goes from the device straight into its destination when
  // that is pinned (the backend's chunk buffers), so no pass over Y runs on
  // the host. A pageable destination (a chunk buffer that fell back to the
  // heap) goes through pinned staging and a host copy, today's speed for
  // it; a device copy into pageable memory would block this thread and run
  // slower.
  absl::Status Run(int64_t rows, absl::Span<const YDestination> outputs,
                   ProjectionRunStats* stats) override {
    if (absl::Status s = CheckLaunch(rows, capacity_, outputs); !s.ok())
      return s;
    if (rows == 0) return absl::OkStatus();
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(x_.as<void>(), host_x_.as<void>(),
                        rows * kProjectionInDim * sizeof(float),
                        cudaMemcpyHostToDevice, stream_),
        "copy x to device");
    if (absl::Status s = kernel_->Forward(x_.as<const float>(), rows,
                                          y_.as<float>(), stream_);
        !s.ok()) {
      cudaStreamSynchronize(stream_);
      return s;
    }
    struct Staged {
      float* to;
      const float* from;
      size_t bytes;
    };
    std::vector<Staged> staged;
    int64_t offset = 0;
    for (const YDestination& output : outputs) {
      const size_t bytes = output.rows * kRowBytes;
      const char* from = y_.as<const char>() + offset * kRowBytes;
      void* to = output.y;
      if (!IsPinned(output.y) && HasYStaging()) {
        to = host_y_.as<char>() + offset * kRowBytes;
        staged.push_back({output.y, reinterpret_cast<const float*>(to), bytes});
      }
      if (absl::Status s = CudaStatus(
              cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToHost, stream_),
              "copy y to host");
          !s.ok()) {
        cudaStreamSynchronize(stream_);
        return s;
      }
      offset += output.rows;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_),
                                 "projection on the GPU");
    if (!staged.empty()) {
      const absl::Time start = absl::Now();
      for (const Staged& piece : staged)
        std::memcpy(piece.to, piece.from, piece.bytes);
      if (stats != nullptr) {
        stats->copy_out_seconds = absl::ToDoubleSeconds(absl::Now() - start);
      }
    }
    return absl::OkStatus();
  }

 private:
  CudaProjectionExecutor(const kernels::ProjectionCuda* kernel, int device,
                         int64_t capacity)
      : kernel_(kernel), device_(device), capacity_(capacity) {}

  // Pinned staging for pageable destinations, allocated on first need; if
  // pinning fails, such pieces are copied into pageable memory directly
  // (slower, blocking) without trying again every launch.
  bool HasYStaging() {
    if (host_y_.bytes() == 0 && !y_staging_failed_) {
      y_staging_failed_ =
          !host_y_.Reserve(capacity_ * kRowBytes, "cudaHostAlloc").ok();
      if (y_staging_failed_) cudaGetLastError();
    }
    return !y_staging_failed_;
  }

  const kernels::ProjectionCuda* kernel_;
  const int device_;
  const int64_t capacity_;
  cudaStream_t stream_ = nullptr;
  PinnedBuffer host_x_;
  PinnedBuffer host_y_;  // only once a destination is pageable
  bool y_staging_failed_ = false;
  DeviceBuffer x_, y_;
};

class CudaProjectionBackend final : public ProjectionBackend {
 public:
  static absl::StatusOr<std::unique_ptr<ProjectionBackend>> Create(
      const ProjectionBackendOptions& options) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      return absl::UnavailableError("no CUDA device on this machine");
    }
    // The projection runs on one GPU; "all"/"auto" use the first.
    const int device = options.device_index < 0 ? 0 : options.device_index;
    if (device >= count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda:", device, " requested but only ", count, " GPU(s) visible"));
    }
    cudaDeviceProp props;
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&props, device),
                                 "cudaGetDeviceProperties");
    // Built for every GPU from Ampere on (PORTABLE_GENCODE).
    if (props.major < 8) {
      return absl::UnavailableError(absl::StrCat(
          "cuda:", device, " is sm_", props.major, props.minor,
          "; the projection kernels need compute capability >= 8.0"));
    }
    int driver_version = 0;
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaDriverGetVersion(&driver_version),
                                 "cudaDriverGetVersion");
    std::unique_ptr<CudaProjectionBackend> backend(new CudaProjectionBackend());
    backend->device_ = device;
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
    const ProjectionWeights& weights = *options.weights;
    // The kernel copies the weights at Create; these uploads are temporary.
    DeviceBuffer weight, bias;
    if (absl::Status s =
            weight.Allocate(weights.weight.size() * sizeof(float), "weights");
        !s.ok()) {
      return s;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpy(weight.as<void>(), weights.weight.data(),
                   weights.weight.size() * sizeof(float),
                   cudaMemcpyHostToDevice),
        "upload projection weights");
    if (!weights.bias.empty()) {
      if (absl::Status s =
              bias.Allocate(weights.bias.size() * sizeof(float), "bias");
          !s.ok()) {
        return s;
      }
      DETLOGP_RETURN_IF_CUDA_ERROR(
          cudaMemcpy(bias.as<void>(), weights.bias.data(),
                     weights.bias.size() * sizeof(float),
                     cudaMemcpyHostToDevice),
          "upload projection bias");
    }
    kernels::ProjectionCuda::Options kernel_options;
    kernel_options.weight = weight.as<const float>();
    kernel_options.bias =
        weights.bias.empty() ? nullptr : bias.as<const float>();
    kernel_options.device = device;
    auto kernel = kernels::ProjectionCuda::Create(kernel_options);
    if (!kernel.ok()) return kernel.status();
    backend->kernel_ = *std::move(kernel);
    backend->description_.name = "cuda";
    backend->description_.device =
        absl::StrCat("cuda:", device, " ", props.name);
    // The cubin the driver loads, or JIT-compiled PTX and the driver's
    // version (kernels/cuda/kernel_kind.h).
    const int cubin = kernels::cuda::BestShippedSass(
        props.major, props.minor, kernels::cuda::kPortableSassArchs);
    backend->description_.instruction_set =
        kernels::cuda::PortableInstructionSet(
            props.major, props.minor,
            cubin != 0 ? cubin : props.major * 10 + props.minor,
            kernels::cuda::kPortablePtxArch, driver_version,
            kernels::cuda::kPortableSassArchs);
    backend->description_.kernel_version =
        kernels::ProjectionCuda::KernelVersion();
    // Measured when each launch still copied its output out of pinned
    // staging on its own thread (~45 MB per 2048 rows): on the H200 host
    // four videos at once went from 4.9 GB/s with two launches in flight to
    // 9.1 with four. With Y going straight into the pinned chunks, two in
    // flight were no faster (docs/performance.md, "H3 projection streaming").
    backend->description_.preferred_inflight_batches = 4;
    auto pool = NewPinnedPool(device, options.max_cached_host_buffer_bytes);
    if (!pool.ok()) return pool.status();
    backend->host_buffers_ = *std::move(pool);
    return std::unique_ptr<ProjectionBackend>(std::move(backend));
  }

  const BackendDescription& description() const override {
    return description_;
  }

  absl::StatusOr<std::unique_ptr<ProjectionExecutor>> NewExecutor(
      int64_t max_rows) override {
    auto executor =
        CudaProjectionExecutor::Create(kernel_.get(), device_, max_rows);
    if (!executor.ok()) return executor.status();
    return std::unique_ptr<ProjectionExecutor>(*std::move(executor));
  }

  std::shared_ptr<HostBufferPool> host_buffer_pool() override {
    return host_buffers_;
  }

 private:
  CudaProjectionBackend() = default;
  int device_ = 0;
  // Shared with the service and every buffer out, which may outlive this.
  std::shared_ptr<HostBufferPool> host_buffers_;
  std::unique_ptr<kernels::ProjectionCuda> kernel_;
  BackendDescription description_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProjectionBackend>> CreateCudaProjectionBackend(
    const ProjectionBackendOptions& options) {
  if (options.weights == nullptr) {
    return absl::InvalidArgumentError("projection: no weights");
  }
  return CudaProjectionBackend::Create(options);
}

}  // namespace detlogp::server
