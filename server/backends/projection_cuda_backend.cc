// The projection on the GPU: kernels/cuda/projection_cuda with pinned
// staging and a stream per executor. Same bits as the CPU backend.
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/kernel_kind.h"
#include "kernels/cuda/projection_cuda.h"
#include "kernels/projection.h"
#include "server/backends/cuda_buffers.h"
#include "server/backends/projection_backend.h"

namespace detlogp::server {
namespace {

using kernels::kProjectionInDim;
using kernels::kProjectionOutDim;

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
    const size_t y_bytes = capacity * kProjectionOutDim * sizeof(float);
    for (auto [buffer, bytes] : {std::pair{&executor->host_x_, x_bytes},
                                 {&executor->host_y_, y_bytes}}) {
      if (absl::Status s = buffer->Allocate(bytes, "cudaHostAlloc"); !s.ok()) return s;
    }
    for (auto [buffer, bytes] : {std::pair{&executor->x_, x_bytes},
                                 {&executor->y_, y_bytes}}) {
      if (absl::Status s = buffer->Allocate(bytes, "cudaMalloc"); !s.ok()) return s;
    }
    return executor;
  }

  ~CudaProjectionExecutor() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  ProjectionStaging staging() override {
    return {capacity_, host_x_.as<float>(), host_y_.as<float>()};
  }

  absl::Status Run(int64_t rows) override {
    if (rows > capacity_) return absl::InternalError("batch exceeds staging");
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
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host_y_.as<void>(), y_.as<void>(),
                        rows * kProjectionOutDim * sizeof(float),
                        cudaMemcpyDeviceToHost, stream_),
        "copy y to host");
    return CudaStatus(cudaStreamSynchronize(stream_), "projection on the GPU");
  }

 private:
  CudaProjectionExecutor(const kernels::ProjectionCuda* kernel, int device,
                         int64_t capacity)
      : kernel_(kernel), device_(device), capacity_(capacity) {}

  const kernels::ProjectionCuda* kernel_;
  const int device_;
  const int64_t capacity_;
  cudaStream_t stream_ = nullptr;
  PinnedBuffer host_x_, host_y_;
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
    if (absl::Status s = weight.Allocate(weights.weight.size() * sizeof(float), "weights");
        !s.ok()) {
      return s;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpy(weight.as<void>(), weights.weight.data(),
                   weights.weight.size() * sizeof(float), cudaMemcpyHostToDevice),
        "upload projection weights");
    if (!weights.bias.empty()) {
      if (absl::Status s = bias.Allocate(weights.bias.size() * sizeof(float), "bias");
          !s.ok()) {
        return s;
      }
      DETLOGP_RETURN_IF_CUDA_ERROR(
          cudaMemcpy(bias.as<void>(), weights.bias.data(),
                     weights.bias.size() * sizeof(float), cudaMemcpyHostToDevice),
          "upload projection bias");
    }
    kernels::ProjectionCuda::Options kernel_options;
    kernel_options.weight = weight.as<const float>();
    kernel_options.bias = weights.bias.empty() ? nullptr : bias.as<const float>();
    kernel_options.device = device;
    auto kernel = kernels::ProjectionCuda::Create(kernel_options);
    if (!kernel.ok()) return kernel.status();
    backend->kernel_ = *std::move(kernel);
    backend->description_.name = "cuda";
    backend->description_.device = absl::StrCat("cuda:", device, " ", props.name);
    // The cubin the driver loads, or JIT-compiled PTX and the driver's
    // version (kernels/cuda/kernel_kind.h).
    const int cubin = kernels::cuda::BestShippedSass(
        props.major, props.minor, kernels::cuda::kPortableSassArchs);
    backend->description_.instruction_set = kernels::cuda::PortableInstructionSet(
        props.major, props.minor,
        cubin != 0 ? cubin : props.major * 10 + props.minor,
        kernels::cuda::kPortablePtxArch, driver_version,
        kernels::cuda::kPortableSassArchs);
    backend->description_.kernel_version = kernels::ProjectionCuda::KernelVersion();
    // Each launch copies its output out of pinned staging on its own
    // thread (~45 MB per 2048 rows); on the H200 host four videos at once
    // went from 4.9 GB/s with two launches in flight to 9.1 with four
    // (docs/perf.md, "H3 projection streaming, session 10").
    backend->description_.preferred_inflight_batches = 4;
    return std::unique_ptr<ProjectionBackend>(std::move(backend));
  }

  const BackendDescription& description() const override { return description_; }

  absl::StatusOr<std::unique_ptr<ProjectionExecutor>> NewExecutor(
      int64_t max_rows) override {
    auto executor = CudaProjectionExecutor::Create(kernel_.get(), device_, max_rows);
    if (!executor.ok()) return executor.status();
    return std::unique_ptr<ProjectionExecutor>(*std::move(executor));
  }

 private:
  CudaProjectionBackend() = default;
  int device_ = 0;
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
