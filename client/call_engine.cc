#include "client/call_engine.h"

#include <algorithm>
#include <optional>
#include <random>
#include <utility>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/request_bytes.h"
#include "proto/status_details.h"

namespace detlogp::client {

void RowWindow::SetCapacity(int64_t rows) {
  absl::MutexLock lock(&mu_);
  capacity_ = std::max<int64_t>(rows, 0);
}

int64_t RowWindow::capacity() const {
  absl::MutexLock lock(&mu_);
  return capacity_;
}

bool RowWindow::TryAcquire(int64_t rows) {
  absl::MutexLock lock(&mu_);
  if (capacity_ > 0 && outstanding_ > 0 && outstanding_ + rows > capacity_) {
    return false;
  }
  outstanding_ += rows;
  return true;
}

void RowWindow::Release(int64_t rows) {
  absl::MutexLock lock(&mu_);
  outstanding_ -= rows;
}

int64_t RowWindow::outstanding() const {
  absl::MutexLock lock(&mu_);
  return outstanding_;
}

namespace {

constexpr char kComputeMethod[] = "/detlogp.v1.LogProbService/ComputeLogProbs";
using RawStub =
    grpc::TemplatedGenericStub<grpc::ByteBuffer, detlogp::v1::LogProbResponse>;
// How often a call whose rows do not fit the window looks again (other
// calls of the client release theirs without waking this one).
constexpr absl::Duration kWindowPoll = absl::Milliseconds(1);

// One request on the wire; owned by the part until its callback ran.
struct Outstanding {
  grpc::ClientContext context;
  grpc::ByteBuffer request;
  detlogp::v1::LogProbResponse response;
};

struct PartState {
  enum class Stage { kWaiting, kInFlight, kDone };
  Stage stage = Stage::kWaiting;
  absl::Time not_before = absl::InfinitePast();
  int connection = -1;
  std::unique_ptr<Outstanding> call;
  std::optional<grpc::Status> completion;
  std::optional<ScoreResult> answer;
};

// One call's requests and what became of them; every member but the parts'
// headers is guarded by mu.
class CallRun {
 public:
  CallRun(std::vector<CallPart> parts,
          const std::vector<std::shared_ptr<grpc::Channel>>& connections,
          RowWindow& window, const CallEngineOptions& options,
          absl::Time deadline)
      : parts_(std::move(parts)),
        window_(window),
        options_(options),
        deadline_(deadline),
        state_(parts_.size()),
        in_flight_on_(connections.size(), 0) {
    for (const auto& channel : connections) stubs_.emplace_back(channel);
    for (const CallPart& part : parts_) {
      total_rows_ += part.header.target_ids_size();
    }
  }

  absl::StatusOr<std::vector<ScoreResult>> Run(CallStats* stats) {
    absl::MutexLock lock(&mu_);
    while (done_ < parts_.size() && failure_.ok()) {
      std::vector<size_t> to_send = PickLocked();
      if (!to_send.empty()) {
        mu_.Unlock();
        for (size_t i : to_send) {
          if (options_.senders != nullptr) {
            options_.senders->Schedule([this, i] { Send(i); });
          } else {
            Send(i);
          }
        }
        mu_.Lock();
        continue;
      }
      HandleCompletionsLocked();
      if (done_ == parts_.size() || !failure_.ok()) break;
      if (!completions_.empty()) continue;
      const absl::Time now = absl::Now();
      if (now >= deadline_ && outstanding_ == 0) {
        failure_ = DeadlineError("before every request was sent");
        break;
      }
      cv_.WaitWithDeadline(&mu_, WakeTimeLocked(now));
    }
    if (!failure_.ok()) {
      for (PartState& part : state_) {
        if (part.stage == PartState::Stage::kInFlight) {
          part.call->context.TryCancel();
        }
      }
    }
    // Callbacks reference this run: wait for every one of them (a
    // completion queued before this wait signalled already).
    HandleCompletionsLocked();
    while (outstanding_ > 0) {
      if (completions_.empty()) cv_.Wait(&mu_);
      HandleCompletionsLocked();
    }
    if (stats != nullptr) *stats = stats_;
    if (!failure_.ok()) return failure_;
    std::vector<ScoreResult> answers;
    answers.reserve(parts_.size());
    for (PartState& part : state_) answers.push_back(*std::move(part.answer));
    return answers;
  }

 private:
  int64_t RowsOf(size_t i) const { return parts_[i].header.target_ids_size(); }

  // The waiting parts that may go now, in order, each given a connection
  // and its rows taken from the window.
  std::vector<size_t> PickLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<size_t> picked;
    window_blocked_ = false;
    const absl::Time now = absl::Now();
    const int per_connection =
        std::max(options_.requests_in_flight_per_connection, 1);
    for (size_t i = first_unfinished_; i < parts_.size(); ++i) {
      PartState& part = state_[i];
      if (part.stage != PartState::Stage::kWaiting || part.not_before > now) {
        continue;
      }
      auto least = std::min_element(in_flight_on_.begin(), in_flight_on_.end());
      if (*least >= per_connection) break;
      if (!window_.TryAcquire(RowsOf(i))) {
        window_blocked_ = true;
        break;
      }
      ++*least;
      ++outstanding_;
      part.connection = static_cast<int>(least - in_flight_on_.begin());
      part.stage = PartState::Stage::kInFlight;
      part.call = std::make_unique<Outstanding>();
      part.completion.reset();
      if (version_.has_value()) {
        parts_[i].header.set_model_version(*version_);
      }
      picked.push_back(i);
    }
    return picked;
  }

  // Outside the lock: the request's bytes are written here. Nothing of
  // this run is touched once the call started (its answer may end the run).
  void Send(size_t i) {
    Outstanding* call;
    int connection;
    {
      absl::MutexLock lock(&mu_);
      call = state_[i].call.get();
      connection = state_[i].connection;
      ++stats_.requests_sent;
    }
    const CallPart& request = parts_[i];
    call->request = request.rows.empty()
                        ? SerializeRequest(request.header)
                        : SerializeWithRows(request.header, request.rows);
    options_.prepare_context(&call->context, deadline_);
    stubs_[connection].UnaryCall(
        &call->context, kComputeMethod, grpc::StubOptions(), &call->request,
        &call->response, [this, i](grpc::Status status) {
          absl::MutexLock lock(&mu_);
          state_[i].completion = std::move(status);
          completions_.push_back(i);
          cv_.Signal();
        });
  }

  void HandleCompletionsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<size_t> completed;
    completed.swap(completions_);
    for (size_t i : completed) Complete(i);
    while (first_unfinished_ < parts_.size() &&
           state_[first_unfinished_].stage == PartState::Stage::kDone) {
      ++first_unfinished_;
    }
  }

  void Complete(size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    PartState& part = state_[i];
    window_.Release(RowsOf(i));
    --in_flight_on_[part.connection];
    --outstanding_;
    const grpc::Status status = *std::move(part.completion);
    std::unique_ptr<Outstanding> call = std::move(part.call);
    part.stage = PartState::Stage::kWaiting;
    if (!failure_.ok()) return;  // the call already failed
    if (!status.ok()) {
      Refused(i, FromGrpcStatus(status));
      return;
    }
    absl::StatusOr<ScoreResult> answer =
        ToScoreResult(parts_[i].header, call->response);
    if (!answer.ok()) {
      failure_ = answer.status();
      return;
    }
    if (!version_.has_value()) version_ = answer->model_version;
    if (answer->model_version != *version_) {
      // Published meanwhile: asked again on the call's version.
      ++stats_.version_retries;
      return;
    }
    part.answer = *std::move(answer);
    part.stage = PartState::Stage::kDone;
    ++done_;
    rows_answered_ += RowsOf(i);
  }

  // A request the server did not answer: sent again after the server's
  // delay when its queue was full and the deadline allows, else the call's
  // failure.
  void Refused(size_t i, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const v1::ErrorDetails details = v1::DetailsOf(status);
    if (details.reason == v1::kReasonQueueFull &&
        details.retry_delay.has_value()) {
      absl::Duration delay = *details.retry_delay;
      if (delay <= absl::ZeroDuration()) delay = options_.default_retry_delay;
      delay *= 1.0 + std::uniform_real_distribution<double>(
                         0.0, options_.retry_jitter)(random_);
      const absl::Time again = absl::Now() + delay;
      if (again < deadline_) {
        state_[i].not_before = again;
        ++stats_.queue_full_retries;
        return;
      }
      failure_ = DeadlineError(absl::StrCat("the server's queue stayed full (",
                                            status.message(), ")"));
      return;
    }
    if (status.code() == absl::StatusCode::kDeadlineExceeded) {
      failure_ = DeadlineError(std::string(status.message()));
      return;
    }
    failure_ = InCallRows(std::move(status), parts_[i].first_row);
  }

  // A refusal naming target_ids[i] of one request, renamed to the call's
  // row.
  static absl::Status InCallRows(absl::Status status, int64_t first_row) {
    const v1::ErrorDetails details = v1::DetailsOf(status);
    if (first_row == 0 || details.fields.empty()) return status;
    const std::string& field = details.fields.front();
    absl::string_view index = field;
    int64_t row = 0;
    if (!absl::ConsumePrefix(&index, "target_ids[") ||
        !absl::ConsumeSuffix(&index, "]") || !absl::SimpleAtoi(index, &row)) {
      return status;
    }
    absl::string_view detail = status.message();
    absl::ConsumePrefix(&detail, absl::StrCat(field, ": "));
    return v1::FieldError(status.code(),
                          absl::StrCat("target_ids[", first_row + row, "]"),
                          detail, details.reason, details.metadata);
  }

  absl::Status DeadlineError(absl::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return v1::WithReason(
        absl::DeadlineExceededError(absl::StrCat(
            "the call's deadline passed with ", rows_answered_, " of ",
            total_rows_, " rows answered (", done_, " of ", parts_.size(),
            " requests; ", stats_.queue_full_retries,
            " sent again after a full queue): ", why)),
        v1::CodeName(absl::StatusCode::kDeadlineExceeded),
        {{"rows_answered", absl::StrCat(rows_answered_)},
         {"rows", absl::StrCat(total_rows_)}});
  }

  absl::Time WakeTimeLocked(absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Time wake = deadline_;
    if (window_blocked_) wake = std::min(wake, now + kWindowPoll);
    for (size_t i = first_unfinished_; i < parts_.size(); ++i) {
      if (state_[i].stage == PartState::Stage::kWaiting) {
        wake = std::min(wake, state_[i].not_before);
      }
    }
    return wake;
  }

  std::vector<CallPart> parts_;
  std::vector<RawStub> stubs_;
  RowWindow& window_;
  const CallEngineOptions& options_;
  const absl::Time deadline_;
  int64_t total_rows_ = 0;

  absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<PartState> state_ ABSL_GUARDED_BY(mu_);
  std::vector<int> in_flight_on_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> completions_ ABSL_GUARDED_BY(mu_);
  size_t first_unfinished_ ABSL_GUARDED_BY(mu_) = 0;
  size_t done_ ABSL_GUARDED_BY(mu_) = 0;
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rows_answered_ ABSL_GUARDED_BY(mu_) = 0;
  bool window_blocked_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<int64_t> version_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  CallStats stats_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 random_ ABSL_GUARDED_BY(mu_){std::random_device{}()};
};

}  // namespace

absl::StatusOr<std::vector<ScoreResult>> SendCallParts(
    std::vector<CallPart> parts,
    const std::vector<std::shared_ptr<grpc::Channel>>& connections,
    RowWindow& window, const CallEngineOptions& options, absl::Time deadline,
    CallStats* stats) {
  if (connections.empty()) {
    return absl::InvalidArgumentError("connections: none to send on");
  }
  if (parts.empty()) return std::vector<ScoreResult>{};
  CallRun run(std::move(parts), connections, window, options, deadline);
  return run.Run(stats);
}

}  // namespace detlogp::client
