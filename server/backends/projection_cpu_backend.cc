#include <vector>

#include "kernels/projection.h"
#include "server/backends/projection_backend.h"

namespace detlogp::server {
namespace {

class CpuProjectionExecutor final : public ProjectionExecutor {
 public:
  CpuProjectionExecutor(const kernels::ProjectionCpu* kernel, int64_t capacity)
      : kernel_(kernel),
        x_(capacity * kernels::kProjectionInDim),
        y_(capacity * kernels::kProjectionOutDim) {}

  ProjectionStaging staging() override {
    return {static_cast<int64_t>(x_.size() / kernels::kProjectionInDim),
            x_.data()};
  }

  // One Forward over the whole launch into staging, then a copy per piece:
  // the CPU backend serves tests and small hosts, where one parallel pass
  // beats a pass per (maybe tiny) chunk.
  absl::Status Run(int64_t rows, absl::Span<const YDestination> outputs,
                   ProjectionRunStats* stats) override {
    const int64_t capacity =
        static_cast<int64_t>(x_.size() / kernels::kProjectionInDim);
    if (absl::Status s = CheckLaunch(rows, capacity, outputs); !s.ok())
      return s;
    if (rows == 0) return absl::OkStatus();
    absl::Status status = kernel_->Forward(
        absl::MakeConstSpan(x_.data(), rows * kernels::kProjectionInDim), rows,
        absl::MakeSpan(y_.data(), rows * kernels::kProjectionOutDim));
    if (!status.ok()) return status;
    const double copy_out = CopyOutOfStaging(y_.data(), outputs);
    if (stats != nullptr) stats->copy_out_seconds = copy_out;
    return absl::OkStatus();
  }

 private:
  const kernels::ProjectionCpu* kernel_;
  std::vector<float> x_;
  std::vector<float> y_;
};

class CpuProjectionBackend final : public ProjectionBackend {
 public:
  explicit CpuProjectionBackend(std::unique_ptr<kernels::ProjectionCpu> kernel)
      : kernel_(std::move(kernel)) {
    description_.name = "cpu";
    description_.device = "cpu";
    description_.instruction_set = "x86-64-v3";
    description_.kernel_version = "cpu-fma96-v1";
    description_.preferred_inflight_batches = 1;
  }
  const BackendDescription& description() const override {
    return description_;
  }
  absl::StatusOr<std::unique_ptr<ProjectionExecutor>> NewExecutor(
      int64_t max_rows) override {
    return std::unique_ptr<ProjectionExecutor>(
        new CpuProjectionExecutor(kernel_.get(), max_rows));
  }

 private:
  std::unique_ptr<kernels::ProjectionCpu> kernel_;
  BackendDescription description_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProjectionBackend>> CreateCpuProjectionBackend(
    const ProjectionBackendOptions& options) {
  if (options.weights == nullptr) {
    return absl::InvalidArgumentError("projection: no weights");
  }
  kernels::ProjectionCpu::Options kernel_options;
  kernel_options.weight = options.weights->weight;
  kernel_options.bias = options.weights->bias;
  kernel_options.num_threads = options.cpu_threads;
  auto kernel = kernels::ProjectionCpu::Create(kernel_options);
  if (!kernel.ok()) return kernel.status();
  return std::unique_ptr<ProjectionBackend>(
      new CpuProjectionBackend(*std::move(kernel)));
}

}  // namespace detlogp::server
