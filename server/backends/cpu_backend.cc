#include "server/backends/cpu_backend.h"

#include <vector>

#include "kernels/linear_logp_cpu.h"
#include "kernels/thread_pool.h"

namespace detlogp::server {
namespace {

// The ISA the kernels were compiled for (.bazelrc pins it): part of the key.
constexpr char kCpuInstructionSet[] = "x86-64-v3/no-contract";

class CpuExecutor final : public LogpExecutor {
 public:
  CpuExecutor(const LmHeadWeights* weights, int64_t capacity, int threads)
      : weights_(weights),
        pool_(threads),
        hidden_(capacity * weights->hidden_size),
        targets_(capacity),
        temperatures_(capacity),
        logprobs_(capacity),
        lse_(capacity) {}

  LogpStaging staging() override {
    LogpStaging staging;
    staging.capacity = static_cast<int64_t>(targets_.size());
    staging.hidden = hidden_.data();
    staging.targets = targets_.data();
    staging.temperatures = temperatures_.data();
    staging.logprobs = logprobs_.data();
    staging.lse = lse_.data();
    return staging;
  }

  absl::Status Run(int64_t rows) override {
    if (rows > static_cast<int64_t>(targets_.size())) {
      return absl::InternalError("batch larger than the executor's staging");
    }
    kernels::LogpRowsView view;
    view.rows = rows;
    view.hidden = hidden_.data();
    view.targets = targets_.data();
    view.temperatures = temperatures_.data();
    view.logprobs = logprobs_.data();
    view.lse = lse_.data();
    return kernels::ComputeLinearLogpCpu(weights_->view(), view, &pool_);
  }

 private:
  const LmHeadWeights* weights_;
  kernels::ThreadPool pool_;
  std::vector<uint16_t> hidden_;
  std::vector<int32_t> targets_;
  std::vector<float> temperatures_;
  std::vector<float> logprobs_;
  std::vector<float> lse_;
};

class CpuBackend final : public LogpBackend {
 public:
  CpuBackend(const LmHeadWeights* weights, int threads)
      : weights_(weights), threads_(threads) {
    description_.name = "cpu";
    description_.device = "cpu";
    description_.instruction_set = kCpuInstructionSet;
    description_.kernel_version = kernels::kCpuKernelVersion;
    description_.preferred_inflight_batches = 1;
  }

  const BackendDescription& description() const override {
    return description_;
  }

  absl::StatusOr<std::unique_ptr<LogpExecutor>> NewExecutor(
      int64_t max_batch_rows) override {
    return std::make_unique<CpuExecutor>(weights_, max_batch_rows, threads_);
  }

 private:
  const LmHeadWeights* weights_;
  int threads_;
  BackendDescription description_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LogpBackend>> CreateCpuBackend(
    const BackendOptions& options) {
  if (options.weights == nullptr) {
    return absl::InvalidArgumentError("cpu backend: no weights");
  }
  return std::make_unique<CpuBackend>(options.weights, options.cpu_threads);
}

}  // namespace detlogp::server
