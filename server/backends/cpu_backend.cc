#include "server/backends/cpu_backend.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/linear_logp_cpu.h"
#include "kernels/thread_pool.h"

namespace detlogp::server {
namespace {

// The host weights, shared with whoever else holds them (no copy).
class CpuModel final : public LogpModel {
 public:
  explicit CpuModel(std::shared_ptr<const LmHeadWeights> weights)
      : LogpModel(weights->hidden_size, weights->vocab_size),
        weights_(std::move(weights)) {}
  const LmHeadWeights& weights() const { return *weights_; }
  absl::Status ReadWeights(int64_t offset, int64_t size,
                           char* out) const override {
    const int64_t weight_bytes = static_cast<int64_t>(weights_->weight.size()) *
                                 static_cast<int64_t>(sizeof(uint16_t));
    const int64_t total =
        weight_bytes +
        static_cast<int64_t>(weights_->bias.size() * sizeof(float));
    if (offset < 0 || size < 0 || offset + size > total) {
      return absl::OutOfRangeError(
          absl::StrCat("bytes [", offset, ", ", offset + size, ") of ", total));
    }
    const char* weight = reinterpret_cast<const char*>(weights_->weight.data());
    const char* bias = reinterpret_cast<const char*>(weights_->bias.data());
    const int64_t from_weight =
        std::max<int64_t>(0, std::min(offset + size, weight_bytes) - offset);
    if (from_weight > 0) std::memcpy(out, weight + offset, from_weight);
    if (size > from_weight) {
      std::memcpy(out + from_weight,
                  bias + (offset + from_weight - weight_bytes),
                  size - from_weight);
    }
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<const LmHeadWeights> weights_;
};

class CpuExecutor final : public LogpExecutor {
 public:
  CpuExecutor(int64_t capacity, int threads)
      : capacity_(capacity),
        pool_(threads),
        targets_(capacity),
        temperatures_(capacity),
        logprobs_(capacity),
        lse_(capacity),
        entropy_(capacity),
        top_ids_(capacity * kernels::kMaxTopK),
        top_logprobs_(capacity * kernels::kMaxTopK) {}

  absl::StatusOr<LogpStaging> Stage(const LogpModel& model) override {
    const size_t hidden_values = capacity_ * model.hidden_size();
    if (hidden_.size() < hidden_values) hidden_.resize(hidden_values);
    LogpStaging staging;
    staging.capacity = capacity_;
    staging.hidden = hidden_.data();
    staging.targets = targets_.data();
    staging.temperatures = temperatures_.data();
    staging.logprobs = logprobs_.data();
    staging.lse = lse_.data();
    staging.entropy = entropy_.data();
    staging.top_ids = top_ids_.data();
    staging.top_logprobs = top_logprobs_.data();
    return staging;
  }

  absl::Status Run(const LogpModel& model, int64_t rows,
                   const LogpExtras& extras) override {
    if (rows > capacity_ ||
        rows * model.hidden_size() > static_cast<int64_t>(hidden_.size())) {
      return absl::InternalError("batch larger than the executor's staging");
    }
    kernels::LogpRowsView view;
    view.rows = rows;
    view.hidden = hidden_.data();
    view.targets = targets_.data();
    view.temperatures = temperatures_.data();
    view.logprobs = logprobs_.data();
    view.lse = lse_.data();
    // Null entropy and top_k 0 run the logp-only loop.
    if (extras.entropy) view.entropy = entropy_.data();
    view.top_k = extras.top_k;
    view.top_ids = top_ids_.data();
    view.top_logprobs = top_logprobs_.data();
    return kernels::ComputeLinearLogpCpu(
        static_cast<const CpuModel&>(model).weights().view(), view, &pool_);
  }

 private:
  const int64_t capacity_;
  kernels::ThreadPool pool_;
  std::vector<uint16_t> hidden_;
  std::vector<int32_t> targets_;
  std::vector<float> temperatures_;
  std::vector<float> logprobs_;
  std::vector<float> lse_;
  std::vector<float> entropy_;
  std::vector<int32_t> top_ids_;     // [capacity, kMaxTopK]
  std::vector<float> top_logprobs_;  // [capacity, kMaxTopK]
};

class CpuBackend final : public LogpBackend {
 public:
  explicit CpuBackend(int threads) : threads_(threads) {
    description_.name = "cpu";
    description_.device = "cpu";
    description_.instruction_set = kernels::kCpuInstructionSet;
    description_.kernel_version = kernels::kCpuKernelVersion;
    description_.preferred_inflight_batches = 1;
  }

  const BackendDescription& description() const override {
    return description_;
  }

  absl::StatusOr<std::shared_ptr<const LogpModel>> Load(
      std::shared_ptr<const LmHeadWeights> weights) override {
    if (weights == nullptr)
      return absl::InvalidArgumentError("cpu backend: no weights");
    return std::make_shared<const CpuModel>(std::move(weights));
  }

  int64_t EstimateBytes(int64_t hidden_size, int64_t padded_vocab_size,
                        bool has_bias) const override {
    return padded_vocab_size * (hidden_size * 2 + (has_bias ? 4 : 0));
  }

  absl::StatusOr<std::unique_ptr<LogpExecutor>> NewExecutor(
      int64_t max_batch_rows) override {
    return std::make_unique<CpuExecutor>(max_batch_rows, threads_);
  }

 private:
  int threads_;
  BackendDescription description_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LogpBackend>> CreateCpuBackend(
    const BackendOptions& options) {
  if (!options.logp_kernel.empty() && options.logp_kernel != "auto") {
    // A forced CUDA kernel never quietly becomes the CPU.
    return absl::FailedPreconditionError(absl::StrCat(
        "--logp_kernel=", options.logp_kernel,
        " chooses a CUDA kernel; the cpu backend has one (use auto)"));
  }
  return std::make_unique<CpuBackend>(options.cpu_threads);
}

}  // namespace detlogp::server
