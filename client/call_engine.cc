#include "client/call_engine.h"

#include <algorithm>
#include <cstring>
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

ReplicaHealth::ReplicaHealth() : ReplicaHealth(Options()) {}

ReplicaHealth::ReplicaHealth(const Options& options) : options_(options) {}

bool ReplicaHealth::Usable(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  return up_ || (!probing_ && now >= next_probe_);
}

bool ReplicaHealth::TryUse(absl::Time now, bool* probe) {
  absl::MutexLock lock(&mu_);
  *probe = false;
  if (up_) return true;
  if (probing_ || now < next_probe_) return false;
  probing_ = true;
  *probe = true;
  return true;
}

void ReplicaHealth::Answered() {
  absl::MutexLock lock(&mu_);
  up_ = true;
  probing_ = false;
  backoff_ = absl::ZeroDuration();
  next_probe_ = absl::InfinitePast();
}

void ReplicaHealth::Failed(absl::Time now) {
  absl::MutexLock lock(&mu_);
  // Requests sent before the first failure fail alike: only the first, or a
  // failed probe, stretches the backoff.
  if (up_ || probing_) {
    backoff_ = backoff_ == absl::ZeroDuration()
                   ? options_.first_backoff
                   : std::min(backoff_ * 2, options_.max_backoff);
    next_probe_ = now + backoff_;
  }
  up_ = false;
  probing_ = false;
}

void ReplicaHealth::AbandonProbe() {
  absl::MutexLock lock(&mu_);
  probing_ = false;
}

bool ReplicaHealth::up() const {
  absl::MutexLock lock(&mu_);
  return up_;
}

absl::Time ReplicaHealth::next_probe() const {
  absl::MutexLock lock(&mu_);
  return up_ ? absl::InfinitePast() : next_probe_;
}

namespace {

constexpr char kComputeMethod[] = "/detlogp.v1.LogProbService/ComputeLogProbs";
using RawStub =
    grpc::TemplatedGenericStub<grpc::ByteBuffer, detlogp::v1::LogProbResponse>;
// How often a call whose rows do not fit a window, or whose replicas are all
// busy or down, looks again (other calls of the client release rows, and
// replicas come back, without waking this one).
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
  int replica = -1;
  int connection = -1;
  // Whether this request is its replica's probe.
  bool probe = false;
  // Replicas that failed this request (it is not sent there again).
  std::vector<bool> failed_on;
  std::unique_ptr<Outstanding> call;
  std::optional<grpc::Status> completion;
  std::optional<ScoreResult> answer;
};

// A failure that says the replica, not the request, is the problem: the
// request goes to another replica.
bool ReplicaFailed(const absl::Status& status) {
  if (status.code() == absl::StatusCode::kUnavailable) return true;
  // A server cancels its calls when it stops; this call cancels its own only
  // after it failed, and then no completion is looked at.
  if (status.code() == absl::StatusCode::kCancelled) return true;
  return v1::DetailsOf(status).reason == v1::kReasonShuttingDown;
}

// The replica lacks the model or the version the request names: another
// replica may hold it.
bool VersionMissing(const absl::Status& status) {
  const std::string reason = v1::DetailsOf(status).reason;
  return reason == v1::kReasonVersionUnavailable ||
         reason == v1::kReasonModelNotFound;
}

// One call's requests and what became of them; every member but the parts'
// headers is guarded by mu.
class CallRun {
 public:
  CallRun(std::vector<CallPart> parts, const std::vector<CallReplica>& replicas,
          const CallEngineOptions& options, absl::Time deadline)
      : parts_(std::move(parts)),
        replicas_(replicas),
        options_(options),
        deadline_(deadline),
        state_(parts_.size()),
        in_flight_on_(replicas.size()),
        lacks_version_(replicas.size(), false) {
    stubs_.resize(replicas.size());
    for (size_t r = 0; r < replicas.size(); ++r) {
      for (const auto& channel : replicas[r].connections) {
        stubs_[r].emplace_back(channel);
      }
      in_flight_on_[r].assign(replicas[r].connections.size(), 0);
    }
    for (PartState& part : state_)
      part.failed_on.assign(replicas.size(), false);
    for (const CallPart& part : parts_) {
      total_rows_ += part.header.target_ids_size();
    }
    stats_.answered_by.assign(replicas.size(), 0);
  }

  absl::StatusOr<std::vector<ScoreResult>> Run(CallStats* stats) {
    absl::MutexLock lock(&mu_);
    while (done_ < parts_.size() && failure_.ok()) {
      std::vector<size_t> to_send = PickLocked();
      if (!failure_.ok()) break;
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

  // Whether replica `r` may still answer part `i` in this call.
  bool MayTry(size_t i, size_t r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !state_[i].failed_on[r] && !lacks_version_[r] && !Retired(r);
  }

  bool Retired(size_t r) const {
    return replicas_[r].retired != nullptr &&
           replicas_[r].retired->load(std::memory_order_relaxed);
  }

  // How full a replica's window is; the least full takes the next request.
  double Load(size_t r) const {
    const RowWindow& window = *replicas_[r].window;
    int64_t capacity = window.capacity();
    if (capacity <= 0)
      capacity = std::max<int64_t>(options_.unknown_queue_rows, 1);
    return static_cast<double>(window.outstanding()) /
           static_cast<double>(capacity);
  }

  // The waiting parts that may go now, in order, each given a replica and a
  // connection and its rows taken from that replica's window. A part with no
  // replica left to try fails the call.
  std::vector<size_t> PickLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<size_t> picked;
    blocked_ = false;
    const absl::Time now = absl::Now();
    const int per_connection =
        std::max(options_.requests_in_flight_per_connection, 1);
    std::vector<size_t> order(replicas_.size());
    for (size_t i = first_unfinished_; i < parts_.size(); ++i) {
      PartState& part = state_[i];
      if (part.stage != PartState::Stage::kWaiting || part.not_before > now) {
        continue;
      }
      // The replicas that may take it, least loaded first.
      order.clear();
      for (size_t r = 0; r < replicas_.size(); ++r) {
        if (MayTry(i, r)) order.push_back(r);
      }
      if (order.empty()) {
        failure_ = NoReplicaLeft();
        return picked;
      }
      std::vector<double> load(replicas_.size());
      for (size_t r : order) load[r] = Load(r);
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return load[a] < load[b]; });
      bool sent = false;
      for (size_t r : order) {
        std::vector<int>& on = in_flight_on_[r];
        auto least = std::min_element(on.begin(), on.end());
        if (*least >= per_connection) continue;
        if (!replicas_[r].health->Usable(now)) continue;
        if (!replicas_[r].window->TryAcquire(RowsOf(i))) continue;
        bool probe = false;
        if (!replicas_[r].health->TryUse(now, &probe)) {
          replicas_[r].window->Release(RowsOf(i));
          continue;
        }
        ++*least;
        ++outstanding_;
        part.replica = static_cast<int>(r);
        part.connection = static_cast<int>(least - on.begin());
        part.probe = probe;
        part.stage = PartState::Stage::kInFlight;
        part.call = std::make_unique<Outstanding>();
        part.completion.reset();
        if (version_.has_value()) {
          parts_[i].header.set_model_version(*version_);
        }
        picked.push_back(i);
        sent = true;
        break;
      }
      if (!sent) {
        // Every replica it may go to is busy, full or down: later parts wait
        // behind it.
        blocked_ = true;
        break;
      }
    }
    return picked;
  }

  // Outside the lock: the request's bytes are written here. Nothing of
  // this run is touched once the call started (its answer may end the run).
  void Send(size_t i) {
    Outstanding* call;
    int replica;
    int connection;
    {
      absl::MutexLock lock(&mu_);
      call = state_[i].call.get();
      replica = state_[i].replica;
      connection = state_[i].connection;
      ++stats_.requests_sent;
    }
    const CallPart& request = parts_[i];
    if (request.region_rows != nullptr) {
      std::memcpy(request.region_rows, request.region_source.data(),
                  request.region_source.size());
    }
    call->request = request.rows.empty()
                        ? SerializeRequest(request.header)
                        : SerializeWithRows(request.header, request.rows);
    options_.prepare_context(&call->context, deadline_);
    stubs_[replica][connection].UnaryCall(
        &call->context, method_, grpc::StubOptions(), &call->request,
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
    const CallReplica& replica = replicas_[part.replica];
    replica.window->Release(RowsOf(i));
    --in_flight_on_[part.replica][part.connection];
    --outstanding_;
    const grpc::Status status = *std::move(part.completion);
    std::unique_ptr<Outstanding> call = std::move(part.call);
    part.stage = PartState::Stage::kWaiting;
    if (!failure_.ok()) {
      // The call already failed (and cancelled this request): what came
      // back says nothing of the replica.
      if (part.probe) replica.health->AbandonProbe();
      return;
    }
    if (!status.ok()) {
      absl::Status refusal = FromGrpcStatus(status);
      if (ReplicaFailed(refusal)) {
        replica.health->Failed(absl::Now());
        part.failed_on[part.replica] = true;
        last_replica_failure_ =
            absl::StrCat(replica.name, ": ", refusal.ToString());
        if (replicas_.size() == 1) {
          // One server: its own status says it all.
          failure_ = std::move(refusal);
          return;
        }
        ++stats_.replica_retries;
        return;  // sent again to another replica, if one is left
      }
      replica.health->Answered();
      if (VersionMissing(refusal) && replicas_.size() > 1) {
        lacks_version_[part.replica] = true;
        version_refusal_ = InCallRows(std::move(refusal), parts_[i].first_row);
        ++stats_.version_moves;
        return;
      }
      Refused(i, std::move(refusal));
      return;
    }
    replica.health->Answered();
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
    ++stats_.answered_by[part.replica];
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

  // A request every replica failed, or that none left holds the version of.
  absl::Status NoReplicaLeft() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool all_lack_version =
        std::all_of(lacks_version_.begin(), lacks_version_.end(),
                    [](bool lacks) { return lacks; });
    if (all_lack_version && !version_refusal_.ok()) return version_refusal_;
    std::string why = last_replica_failure_;
    if (!version_refusal_.ok()) {
      absl::StrAppend(
          &why, "; the others lack the version: ", version_refusal_.message());
    }
    return v1::WithReason(
        absl::UnavailableError(
            absl::StrCat("no replica left to answer: ", rows_answered_, " of ",
                         total_rows_, " rows answered (", done_, " of ",
                         parts_.size(), " requests, ", stats_.replica_retries,
                         " sent again after a replica failed); ", why)),
        v1::CodeName(absl::StatusCode::kUnavailable),
        {{"rows_answered", absl::StrCat(rows_answered_)},
         {"rows", absl::StrCat(total_rows_)}});
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
    if (blocked_) wake = std::min(wake, now + kWindowPoll);
    for (size_t i = first_unfinished_; i < parts_.size(); ++i) {
      if (state_[i].stage == PartState::Stage::kWaiting) {
        wake = std::min(wake, state_[i].not_before);
      }
    }
    return wake;
  }

  // gRPC keeps a pointer to the method's name for each call's life.
  const std::string method_ = kComputeMethod;
  std::vector<CallPart> parts_;
  const std::vector<CallReplica>& replicas_;
  std::vector<std::vector<RawStub>> stubs_;
  const CallEngineOptions& options_;
  const absl::Time deadline_;
  int64_t total_rows_ = 0;

  absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<PartState> state_ ABSL_GUARDED_BY(mu_);
  // Requests in flight on each replica's connections.
  std::vector<std::vector<int>> in_flight_on_ ABSL_GUARDED_BY(mu_);
  // Replicas that lack the call's model or version.
  std::vector<bool> lacks_version_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> completions_ ABSL_GUARDED_BY(mu_);
  size_t first_unfinished_ ABSL_GUARDED_BY(mu_) = 0;
  size_t done_ ABSL_GUARDED_BY(mu_) = 0;
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rows_answered_ ABSL_GUARDED_BY(mu_) = 0;
  bool blocked_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<int64_t> version_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  // The last replica failure and version refusal, for the call's error.
  std::string last_replica_failure_ ABSL_GUARDED_BY(mu_);
  absl::Status version_refusal_ ABSL_GUARDED_BY(mu_);
  CallStats stats_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 random_ ABSL_GUARDED_BY(mu_){std::random_device{}()};
};

}  // namespace

absl::StatusOr<std::vector<ScoreResult>> SendCallParts(
    std::vector<CallPart> parts, const std::vector<CallReplica>& replicas,
    const CallEngineOptions& options, absl::Time deadline, CallStats* stats) {
  if (replicas.empty()) {
    return absl::InvalidArgumentError("replicas: none to send to");
  }
  for (size_t r = 0; r < replicas.size(); ++r) {
    if (replicas[r].connections.empty() || replicas[r].window == nullptr ||
        replicas[r].health == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replicas[", r, "]: needs a window, a health and a connection"));
    }
  }
  if (parts.empty()) return std::vector<ScoreResult>{};
  CallRun run(std::move(parts), replicas, options, deadline);
  return run.Run(stats);
}

absl::StatusOr<std::vector<ScoreResult>> SendCallParts(
    std::vector<CallPart> parts,
    const std::vector<std::shared_ptr<grpc::Channel>>& connections,
    RowWindow& window, const CallEngineOptions& options, absl::Time deadline,
    CallStats* stats) {
  if (connections.empty()) {
    return absl::InvalidArgumentError("connections: none to send on");
  }
  ReplicaHealth health;
  return SendCallParts(std::move(parts),
                       {CallReplica{&window, &health, connections, "server"}},
                       options, deadline, stats);
}

}  // namespace detlogp::client
