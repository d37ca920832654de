#include "server/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/linear_logp_cuda.h"
#include "server/cuda_buffers.h"

namespace detlogp::server {
namespace {

using kernels::cuda::LinearLogpCuda;

class CudaExecutor final : public LogpExecutor {
 public:
  static absl::StatusOr<std::unique_ptr<CudaExecutor>> Create(
      const LinearLogpCuda* kernel, int device, int64_t hidden_size,
      int64_t capacity) {
    auto executor = std::unique_ptr<CudaExecutor>(
        new CudaExecutor(kernel, device, hidden_size, capacity));
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaStreamCreateWithFlags(&executor->stream_, cudaStreamNonBlocking),
        "cudaStreamCreate");
    const size_t hidden_bytes = capacity * hidden_size * sizeof(uint16_t);
    const size_t row_bytes = capacity * sizeof(float);
    for (auto [buffer, bytes] : {std::pair{&executor->host_hidden_, hidden_bytes},
                                 {&executor->host_targets_, row_bytes},
                                 {&executor->host_temperatures_, row_bytes},
                                 {&executor->host_logprobs_, row_bytes},
                                 {&executor->host_lse_, row_bytes}}) {
      if (absl::Status s = buffer->Allocate(bytes, "cudaHostAlloc"); !s.ok()) {
        return s;
      }
    }
    for (auto [buffer, bytes] :
         {std::pair{&executor->hidden_, hidden_bytes},
          {&executor->targets_, row_bytes},
          {&executor->temperatures_, row_bytes},
          {&executor->logprobs_, row_bytes},
          {&executor->lse_, row_bytes},
          {&executor->workspace_, kernel->WorkspaceBytes(capacity)}}) {
      if (absl::Status s = buffer->Allocate(bytes, "cudaMalloc"); !s.ok()) {
        return s;
      }
    }
    return executor;
  }

  ~CudaExecutor() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  LogpStaging staging() override {
    LogpStaging staging;
    staging.capacity = capacity_;
    staging.hidden = host_hidden_.as<uint16_t>();
    staging.targets = host_targets_.as<int32_t>();
    staging.temperatures = host_temperatures_.as<float>();
    staging.logprobs = host_logprobs_.as<float>();
    staging.lse = host_lse_.as<float>();
    return staging;
  }

  absl::Status Run(int64_t rows) override {
    if (rows > capacity_) {
      return absl::InternalError("batch larger than the executor's staging");
    }
    if (rows == 0) return absl::OkStatus();
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const size_t row_bytes = rows * sizeof(float);
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(hidden_.as<void>(), host_hidden_.as<void>(),
                        rows * hidden_size_ * sizeof(uint16_t),
                        cudaMemcpyHostToDevice, stream_),
        "copy hidden to device");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(targets_.as<void>(), host_targets_.as<void>(),
                        row_bytes, cudaMemcpyHostToDevice, stream_),
        "copy targets to device");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(temperatures_.as<void>(), host_temperatures_.as<void>(),
                        row_bytes, cudaMemcpyHostToDevice, stream_),
        "copy temperatures to device");
    kernels::cuda::LinearLogpBatchView batch;
    batch.hidden = hidden_.as<const __nv_bfloat16>();
    batch.targets = targets_.as<const int32_t>();
    batch.temperatures = temperatures_.as<const float>();
    batch.logprobs = logprobs_.as<float>();
    batch.lse = lse_.as<float>();
    batch.rows = rows;
    if (absl::Status s = kernel_->Launch(batch, workspace_.as<void>(), stream_);
        !s.ok()) {
      cudaStreamSynchronize(stream_);
      return s;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host_logprobs_.as<void>(), logprobs_.as<void>(),
                        row_bytes, cudaMemcpyDeviceToHost, stream_),
        "copy logprobs to host");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host_lse_.as<void>(), lse_.as<void>(), row_bytes,
                        cudaMemcpyDeviceToHost, stream_),
        "copy lse to host");
    return CudaStatus(cudaStreamSynchronize(stream_), "batch on the GPU");
  }

 private:
  CudaExecutor(const LinearLogpCuda* kernel, int device, int64_t hidden_size,
               int64_t capacity)
      : kernel_(kernel),
        device_(device),
        hidden_size_(hidden_size),
        capacity_(capacity) {}

  const LinearLogpCuda* kernel_;
  const int device_;
  const int64_t hidden_size_;
  const int64_t capacity_;
  cudaStream_t stream_ = nullptr;
  PinnedBuffer host_hidden_, host_targets_, host_temperatures_, host_logprobs_,
      host_lse_;
  DeviceBuffer hidden_, targets_, temperatures_, logprobs_, lse_, workspace_;
};

class CudaBackend final : public LogpBackend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(
      const BackendOptions& options) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();  // clear the sticky "no device" error
      return absl::UnavailableError("no CUDA device on this machine");
    }
    const int device = options.device_index;
    if (device >= count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda:", device, " requested but only ", count, " GPU(s) visible"));
    }
    cudaDeviceProp props;
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&props, device),
                                 "cudaGetDeviceProperties");
    if (props.major != 9 || props.minor != 0) {
      return absl::UnavailableError(absl::StrCat(
          "cuda:", device, " (", props.name, ") is sm_", props.major,
          props.minor, "; the kernel is built for sm_90a"));
    }
    auto backend = std::unique_ptr<CudaBackend>(new CudaBackend());
    backend->device_ = device;
    const LmHeadWeights& weights = *options.weights;
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
    const size_t weight_bytes = weights.weight.size() * sizeof(uint16_t);
    if (absl::Status s = backend->weight_.Allocate(weight_bytes, "weights");
        !s.ok()) {
      return s;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpy(backend->weight_.as<void>(), weights.weight.data(),
                   weight_bytes, cudaMemcpyHostToDevice),
        "upload weights");
    if (!weights.bias.empty()) {
      const size_t bias_bytes = weights.bias.size() * sizeof(float);
      if (absl::Status s = backend->bias_.Allocate(bias_bytes, "bias");
          !s.ok()) {
        return s;
      }
      DETLOGP_RETURN_IF_CUDA_ERROR(
          cudaMemcpy(backend->bias_.as<void>(), weights.bias.data(),
                     bias_bytes, cudaMemcpyHostToDevice),
          "upload bias");
    }
    LinearLogpCuda::Options kernel_options;
    kernel_options.device = device;
    kernel_options.weights.weight = backend->weight_.as<const __nv_bfloat16>();
    kernel_options.weights.bias =
        weights.bias.empty() ? nullptr : backend->bias_.as<const float>();
    kernel_options.weights.hidden_size = weights.hidden_size;
    kernel_options.weights.vocab_size = weights.vocab_size;
    kernel_options.weights.padded_vocab_size = weights.padded_vocab_size;
    auto kernel = LinearLogpCuda::Create(kernel_options);
    if (!kernel.ok()) return kernel.status();
    backend->kernel_ = *std::move(kernel);
    backend->hidden_size_ = weights.hidden_size;
    backend->description_.name = "cuda";
    backend->description_.device = absl::StrCat("cuda:", device, " ", props.name);
    backend->description_.instruction_set = "sm_90a";
    backend->description_.kernel_version = LinearLogpCuda::KernelVersion();
    backend->description_.preferred_inflight_batches = 2;
    return backend;
  }

  const BackendDescription& description() const override {
    return description_;
  }

  int64_t DeviceMemoryUsedBytes() const override {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(device_) != cudaSuccess ||
        cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      return 0;
    }
    return static_cast<int64_t>(total_bytes - free_bytes);
  }

  absl::StatusOr<std::unique_ptr<LogpExecutor>> NewExecutor(
      int64_t max_batch_rows) override {
    auto executor = CudaExecutor::Create(kernel_.get(), device_, hidden_size_,
                                         max_batch_rows);
    if (!executor.ok()) return executor.status();
    return std::unique_ptr<LogpExecutor>(*std::move(executor));
  }

 private:
  CudaBackend() = default;

  int device_ = 0;
  int64_t hidden_size_ = 0;
  DeviceBuffer weight_;
  DeviceBuffer bias_;
  // Declared after the buffers it points into, so it is destroyed first.
  std::unique_ptr<LinearLogpCuda> kernel_;
  BackendDescription description_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LogpBackend>> CreateCudaBackend(
    const BackendOptions& options) {
  if (options.weights == nullptr) {
    return absl::InvalidArgumentError("cuda backend: no weights");
  }
  auto backend = CudaBackend::Create(options);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<LogpBackend>(*std::move(backend));
}

}  // namespace detlogp::server
