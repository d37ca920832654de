// One request's rows on their way through the batcher. A job may be cut into
// slices that ride in different batches; it completes exactly once, when
// every row has been computed or dropped.
#ifndef DETLOGP_SERVER_BATCHING_LOGP_JOB_H_
#define DETLOGP_SERVER_BATCHING_LOGP_JOB_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backends/backend.h"

namespace detlogp::server {

class LogpJob {
 public:
  // Called once, from whichever thread finished the last row; `job` is this.
  using DoneCallback = absl::AnyInvocable<void(absl::Status, LogpJob& job)>;

  // Computes on `model` (which the job keeps alive). Borrows `hidden_bf16`
  // (rows x model->hidden_size() bf16 values, little-endian, any
  // alignment), kept valid by `keep_alive`, which the job drops when it
  // completes (before `done` runs).
  LogpJob(std::shared_ptr<const LogpModel> model, int64_t rows,
          const char* hidden_bf16, std::shared_ptr<const void> keep_alive,
          std::vector<int32_t> targets, float temperature, absl::Time deadline,
          DoneCallback done)
      : model_(std::move(model)),
        rows_(rows),
        hidden_size_(model_->hidden_size()),
        hidden_bf16_(hidden_bf16),
        keep_alive_(std::move(keep_alive)),
        targets_(std::move(targets)),
        temperature_(temperature),
        deadline_(deadline),
        logprobs_(rows),
        lse_(rows),
        rows_outstanding_(rows),
        done_(std::move(done)) {}

  // Owns its rows.
  LogpJob(std::shared_ptr<const LogpModel> model, int64_t rows,
          std::vector<uint16_t> hidden_bf16, std::vector<int32_t> targets,
          float temperature, absl::Time deadline, DoneCallback done)
      : LogpJob(std::move(model), rows, nullptr, nullptr, std::move(targets),
                temperature, deadline, std::move(done)) {
    auto owned =
        std::make_shared<const std::vector<uint16_t>>(std::move(hidden_bf16));
    hidden_bf16_ = reinterpret_cast<const char*>(owned->data());
    keep_alive_ = std::move(owned);
  }

  LogpJob(const LogpJob&) = delete;
  LogpJob& operator=(const LogpJob&) = delete;

  // Every row of the job runs on this model.
  const std::shared_ptr<const LogpModel>& model() const { return model_; }
  int64_t rows() const { return rows_; }
  int64_t hidden_size() const { return hidden_size_; }
  // Row r starts at hidden_bf16() + r * hidden_size() * 2 (null when the
  // rows are pieces of the request message: set_hidden_pieces).
  const char* hidden_bf16() const { return hidden_bf16_; }
  // The rows as consecutive pieces of the request message (gRPC's received
  // buffers, kept valid by the caller until the job completes) instead of
  // one block; set before Schedule.
  void set_hidden_pieces(std::vector<absl::string_view> pieces) {
    hidden_pieces_ = std::move(pieces);
  }
  // Copies rows [row_begin, row_begin + count) from host memory to
  // `destination`, from the block or from the pieces.
  void CopyHostRows(int64_t row_begin, int64_t count, char* destination) const {
    const int64_t row_bytes = hidden_size_ * 2;
    int64_t skip = row_begin * row_bytes;
    int64_t left = count * row_bytes;
    if (hidden_pieces_.empty()) {
      std::memcpy(destination, hidden_bf16_ + skip, left);
      return;
    }
    for (absl::string_view piece : hidden_pieces_) {
      const int64_t size = static_cast<int64_t>(piece.size());
      if (skip >= size) {
        skip -= size;
        continue;
      }
      const int64_t take = std::min(size - skip, left);
      std::memcpy(destination, piece.data() + skip, take);
      destination += take;
      left -= take;
      skip = 0;
      if (left == 0) return;
    }
  }
  const std::vector<int32_t>& targets() const { return targets_; }
  float temperature() const { return temperature_; }
  absl::Time deadline() const { return deadline_; }
  std::vector<float>& logprobs() { return logprobs_; }
  std::vector<float>& lse() { return lse_; }

  // What the job asks for beyond logprob and lse; set before Schedule (the
  // batcher reads it). Sizes the outputs: entropy [rows] when asked, top
  // lists [rows, top_k] row-major.
  void set_extras(const LogpExtras& extras) {
    extras_ = extras;
    entropy_.assign(extras.entropy ? rows_ : 0, 0.0f);
    top_ids_.assign(rows_ * extras.top_k, 0);
    top_logprobs_.assign(rows_ * extras.top_k, 0.0f);
  }
  const LogpExtras& extras() const { return extras_; }
  std::vector<float>& entropy() { return entropy_; }
  std::vector<int32_t>& top_ids() { return top_ids_; }
  std::vector<float>& top_logprobs() { return top_logprobs_; }

  // Where hidden_bf16() points (host memory unless set); set before
  // Schedule.
  void set_hidden_location(const HiddenLocation& location) {
    hidden_location_ = location;
  }
  const HiddenLocation& hidden_location() const { return hidden_location_; }

  // When the batches carrying the job's rows ran (called by batch threads):
  // the first start and the last end, for LogProbResponse.timing.
  void NoteBatchRan(absl::Time start, absl::Time end) {
    absl::MutexLock lock(&mu_);
    if (first_batch_start_ == absl::InfiniteFuture() ||
        start < first_batch_start_) {
      first_batch_start_ = start;
    }
    if (end > last_batch_end_) last_batch_end_ = end;
  }
  absl::Time first_batch_start() const {
    absl::MutexLock lock(&mu_);
    return first_batch_start_;
  }
  absl::Time last_batch_end() const {
    absl::MutexLock lock(&mu_);
    return last_batch_end_;
  }

  void Cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

  // Accounts for `count` rows that were computed (status OK) or dropped or
  // failed (status not OK; the first such status is the job's). Completes
  // the job when no rows are left.
  void FinishRows(int64_t count, const absl::Status& status) {
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      if (status_.ok()) status_ = status;
    }
    if (rows_outstanding_.fetch_sub(count, std::memory_order_acq_rel) ==
        count) {
      absl::Status final_status;
      {
        absl::MutexLock lock(&mu_);
        final_status = status_;
      }
      // No batch reads the rows any more: let them go before the answer
      // leaves, so a shared-memory region is free once its caller has it.
      keep_alive_.reset();
      hidden_bf16_ = nullptr;
      hidden_pieces_.clear();
      done_(final_status, *this);
    }
  }

 private:
  const std::shared_ptr<const LogpModel> model_;
  const int64_t rows_;
  const int64_t hidden_size_;
  const char* hidden_bf16_;
  std::vector<absl::string_view> hidden_pieces_;
  std::shared_ptr<const void> keep_alive_;
  const std::vector<int32_t> targets_;
  const float temperature_;
  const absl::Time deadline_;
  std::vector<float> logprobs_;  // each row written by one batch thread
  std::vector<float> lse_;
  LogpExtras extras_;
  HiddenLocation hidden_location_;
  std::vector<float> entropy_;
  std::vector<int32_t> top_ids_;
  std::vector<float> top_logprobs_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> rows_outstanding_;
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Time first_batch_start_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time last_batch_end_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  DoneCallback done_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BATCHING_LOGP_JOB_H_
