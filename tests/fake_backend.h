// A LogpBackend for batcher and server tests: "computes" logprob = first
// hidden bf16 value + target + the model's offset, lse = the row's
// temperature, and when the batch asks (LogpExtras) entropy = |h0| +
// target / 1000 and the top list id i = (target + i) % V with log-prob
// -|h0| - i (descending, the target first); records batch sizes, the model
// and extras of every batch, checks the RowsStaged calls before each Run, can
// be slowed down or made to fail.
//
// Tests that need a batch to be running hold batches at a gate inside Run
// (HoldBatches, WaitForBatchesStarted, ReleaseBatches) instead of sleeping
// until it probably is. With a ManualClock attached, the modeled compute
// time (set_delay) advances that clock instead of sleeping, so the batcher
// measures exactly that duration.
#ifndef DETLOGP_TESTS_FAKE_BACKEND_H_
#define DETLOGP_TESTS_FAKE_BACKEND_H_

#include <atomic>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/bfloat16.h"
#include "server/backends/backend.h"
#include "tests/manual_clock.h"

namespace detlogp::testing {

class FakeModel final : public server::LogpModel {
 public:
  FakeModel(int64_t hidden_size, float offset)
      : LogpModel(hidden_size, 1 << 20), offset_(offset) {}
  float offset() const { return offset_; }

 private:
  const float offset_;
};

class FakeBackend final : public server::LogpBackend {
 public:
  explicit FakeBackend(int64_t hidden_size)
      : default_model_(std::make_shared<FakeModel>(hidden_size, 0.0f)) {
    description_.name = "fake";
    description_.kernel_version = "fake-v1";
  }

  const server::BackendDescription& description() const override {
    return description_;
  }

  // The model of offset 0 that tests use unless they need several.
  const std::shared_ptr<const server::LogpModel>& model() const {
    return default_model_;
  }
  static std::shared_ptr<const server::LogpModel> MakeModel(int64_t hidden_size,
                                                            float offset) {
    return std::make_shared<FakeModel>(hidden_size, offset);
  }

  absl::StatusOr<std::shared_ptr<const server::LogpModel>> Load(
      std::shared_ptr<const server::LmHeadWeights> weights) override {
    return MakeModel(weights->hidden_size, 0.0f);
  }
  int64_t EstimateBytes(int64_t hidden_size, int64_t padded_vocab_size,
                        bool has_bias) const override {
    return padded_vocab_size * (2 * hidden_size + (has_bias ? 4 : 0));
  }

  absl::StatusOr<std::unique_ptr<server::LogpExecutor>> NewExecutor(
      int64_t max_batch_rows) override {
    return std::unique_ptr<server::LogpExecutor>(
        new Executor(this, max_batch_rows));
  }

  // How long each Run takes: advanced on the attached clock, else slept.
  void set_delay(absl::Duration delay) {
    delay_ns_ = absl::ToInt64Nanoseconds(delay);
  }
  // The clock that set_delay advances; null (the default) sleeps instead.
  // Not owned.
  void set_clock(ManualClock* clock) {
    absl::MutexLock lock(&mu_);
    clock_ = clock;
  }

  // From now on every batch waits inside Run, counted as started, until
  // ReleaseBatches.
  void HoldBatches() {
    absl::MutexLock lock(&mu_);
    gate_open_ = false;
  }
  // Lets held batches and later ones run.
  void ReleaseBatches() {
    absl::MutexLock lock(&mu_);
    gate_open_ = true;
  }
  // Blocks until `count` batches in all have entered Run (held or not);
  // false if that does not happen within `timeout` of real time, a guard
  // against hanging.
  bool WaitForBatchesStarted(int64_t count,
                             absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock lock(&mu_);
    StartedArgs args{this, count};
    return mu_.AwaitWithTimeout(absl::Condition(&EnoughStarted, &args),
                                timeout);
  }

  void set_fail(bool fail) { fail_ = fail; }
  int64_t rows_computed() const { return rows_computed_; }
  int64_t batches_started() const {
    absl::MutexLock lock(&mu_);
    return batches_started_;
  }
  // Batches whose RowsStaged calls did not grow step by step up to the rows
  // that Run was asked for.
  int64_t bad_staging_batches() const { return bad_staging_batches_; }
  std::vector<int64_t> batch_sizes() const {
    absl::MutexLock lock(&mu_);
    return batch_sizes_;
  }
  // The offset of each batch's model, in the order batches entered Run.
  std::vector<float> batch_models() const {
    absl::MutexLock lock(&mu_);
    return batch_models_;
  }
  // The extras each batch computed, in the order batches entered Run.
  std::vector<server::LogpExtras> batch_extras() const {
    absl::MutexLock lock(&mu_);
    return batch_extras_;
  }

 private:
  class Executor final : public server::LogpExecutor {
   public:
    Executor(FakeBackend* backend, int64_t capacity)
        : backend_(backend),
          targets_(capacity),
          temperatures_(capacity),
          logprobs_(capacity),
          lse_(capacity),
          entropy_(capacity),
          top_ids_(capacity * kernels::kMaxTopK),
          top_logprobs_(capacity * kernels::kMaxTopK) {}
    absl::StatusOr<server::LogpStaging> Stage(
        const server::LogpModel& model) override {
      hidden_.resize(targets_.size() * model.hidden_size());
      return server::LogpStaging{static_cast<int64_t>(targets_.size()),
                                 hidden_.data(),
                                 targets_.data(),
                                 temperatures_.data(),
                                 logprobs_.data(),
                                 lse_.data(),
                                 entropy_.data(),
                                 top_ids_.data(),
                                 top_logprobs_.data()};
    }
    void RowsStaged(int64_t rows) override {
      if (rows <= staged_rows_) staging_in_order_ = false;
      staged_rows_ = rows;
    }
    absl::Status Run(const server::LogpModel& model, int64_t rows,
                     const server::LogpExtras& extras) override {
      const auto& fake = static_cast<const FakeModel&>(model);
      if (!staging_in_order_ || staged_rows_ != rows)
        ++backend_->bad_staging_batches_;
      staged_rows_ = 0;
      staging_in_order_ = true;
      ManualClock* clock;
      {
        absl::MutexLock lock(&backend_->mu_);
        ++backend_->batches_started_;
        backend_->batch_sizes_.push_back(rows);
        backend_->batch_models_.push_back(fake.offset());
        backend_->batch_extras_.push_back(extras);
        backend_->mu_.Await(absl::Condition(&backend_->gate_open_));
        clock = backend_->clock_;
      }
      const absl::Duration delay =
          absl::Nanoseconds(backend_->delay_ns_.load());
      if (clock != nullptr) {
        clock->Advance(delay);
      } else {
        absl::SleepFor(delay);
      }
      if (backend_->fail_) return absl::InternalError("fake backend failure");
      for (int64_t r = 0; r < rows; ++r) {
        logprobs_[r] = kernels::Bf16ToFloat(hidden_[r * model.hidden_size()]) +
                       static_cast<float>(targets_[r]) + fake.offset();
        lse_[r] = temperatures_[r];
        const float h0 =
            std::fabs(kernels::Bf16ToFloat(hidden_[r * model.hidden_size()]));
        if (extras.entropy)
          entropy_[r] = h0 + 0.001f * static_cast<float>(targets_[r]);
        for (int32_t i = 0; i < extras.top_k; ++i) {
          top_ids_[r * extras.top_k + i] =
              static_cast<int32_t>((targets_[r] + i) % model.vocab_size());
          top_logprobs_[r * extras.top_k + i] = -h0 - static_cast<float>(i);
        }
      }
      backend_->rows_computed_ += rows;
      return absl::OkStatus();
    }

   private:
    FakeBackend* backend_;
    int64_t staged_rows_ = 0;
    bool staging_in_order_ = true;
    std::vector<uint16_t> hidden_;
    std::vector<int32_t> targets_;
    std::vector<float> temperatures_;
    std::vector<float> logprobs_;
    std::vector<float> lse_;
    std::vector<float> entropy_;
    std::vector<int32_t> top_ids_;
    std::vector<float> top_logprobs_;
  };

  struct StartedArgs {
    FakeBackend* backend;
    int64_t count;
  };
  static bool EnoughStarted(StartedArgs* args)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {  // evaluated under mu_
    return args->backend->batches_started_ >= args->count;
  }

  const std::shared_ptr<const server::LogpModel> default_model_;
  server::BackendDescription description_;
  std::atomic<int64_t> delay_ns_{0};
  std::atomic<bool> fail_{false};
  std::atomic<int64_t> rows_computed_{0};
  std::atomic<int64_t> bad_staging_batches_{0};
  mutable absl::Mutex mu_;
  ManualClock* clock_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool gate_open_ ABSL_GUARDED_BY(mu_) = true;
  int64_t batches_started_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> batch_sizes_ ABSL_GUARDED_BY(mu_);
  std::vector<float> batch_models_ ABSL_GUARDED_BY(mu_);
  std::vector<server::LogpExtras> batch_extras_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_FAKE_BACKEND_H_
