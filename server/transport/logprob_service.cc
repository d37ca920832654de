#include "server/transport/logprob_service.h"

#include <chrono>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/transport/grpc_status.h"
#include "server/transport/local_peer.h"
#include "server/transport/reactor_update.h"
#include "server/transport/rejected_call.h"
#include "server/transport/request_wire.h"
#include "proto/status_details.h"

namespace detlogp::server {
namespace {

using detlogp::v1::LogProbRequest;
using detlogp::v1::LogProbResponse;

absl::Time DeadlineOf(const grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  // gRPC reports "no deadline" as the far future; keep it out of absl's
  // arithmetic range.
  if (deadline >=
      std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

// Where a request's time went: validation, the queue, the batches.
void FillTiming(const LogpJob& job, absl::Time arrived, absl::Time scheduled,
                detlogp::v1::ServerTiming* timing) {
  const absl::Time now = absl::Now();
  timing->set_validate_us(absl::ToInt64Microseconds(scheduled - arrived));
  const absl::Time first = job.first_batch_start();
  if (first != absl::InfiniteFuture()) {  // rows were computed
    timing->set_queue_us(absl::ToInt64Microseconds(first - scheduled));
    timing->set_compute_us(
        absl::ToInt64Microseconds(job.last_batch_end() - first));
  }
  timing->set_total_us(absl::ToInt64Microseconds(now - arrived));
}

}  // namespace

grpc::Status LogProbServiceImpl::Record(absl::string_view method,
                                        grpc::Status status) const {
  if (options_.on_call_done) options_.on_call_done(method, status.error_code());
  return status;
}

grpc::Status LogProbServiceImpl::Authenticate(
    const grpc::CallbackServerContext& context) const {
  if (options_.authenticator == nullptr) return grpc::Status::OK;
  return ToGrpcStatus(options_.authenticator->Check(context));
}

LogProbServiceImpl::Caller LogProbServiceImpl::CallerOf(
    const grpc::CallbackServerContext& context) const {
  Caller caller;
  if (options_.shared_memory == nullptr) return caller;
  caller.token = TokenAuthenticator::PresentedToken(context);
  const std::string peer = context.peer();
  caller.same_host = options_.is_same_host ? options_.is_same_host(peer)
                                           : IsSameHostPeer(peer);
  return caller;
}

LogProbServiceImpl::LogProbServiceImpl(const Options& options,
                                       const ModelManager* models,
                                       DynamicBatcher* batcher)
    : options_(options), models_(models), batcher_(batcher) {}

absl::Status LogProbServiceImpl::Submit(
    const LogProbRequest& request, const Caller& caller,
    std::shared_ptr<const void> request_owner, absl::Time deadline,
    LogProbResponse* response, absl::AnyInvocable<void(absl::Status)> done,
    std::shared_ptr<LogpJob>* job,
    const std::vector<absl::string_view>* message_rows) {
  const absl::Time arrived = absl::Now();
  if (request.model_version() < 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "model_version",
                          absl::StrCat(request.model_version(),
                                       " is negative (0 means the latest)"));
  }
  // The whole request runs on this version; the handle keeps it loaded
  // until the answer is built.
  auto version = models_->Resolve(request.model(), request.model_version());
  if (!version.ok()) return version.status();
  RequestLimits limits;
  limits.hidden_size = (*version)->hidden_size;
  limits.vocab_size = (*version)->vocab_size;
  limits.max_request_rows = options_.max_request_rows;
  limits.max_top_k = options_.max_top_k;
  limits.extras_unavailable = options_.extras_unavailable;
  SharedMemoryResolver resolve;
  if (options_.shared_memory != nullptr && caller.same_host) {
    resolve = [this, &caller](const detlogp::v1::SharedMemoryRef& ref)
        -> absl::StatusOr<SharedMemoryBytes> {
      auto lease = options_.shared_memory->Acquire(
          caller.token, ref.region(), ref.offset(), ref.byte_size(),
          "hidden.shared_memory");
      if (!lease.ok()) return lease.status();
      SharedMemoryBytes bytes;
      bytes.data = (*lease)->data();
      bytes.location = (*lease)->location();
      bytes.hold = *std::move(lease);
      return bytes;
    };
  }
  auto rows = ValidateLogProbRequest(request, limits, resolve, message_rows);
  if (!rows.ok()) return rows.status();
  if (options_.on_hidden_bytes) {
    static constexpr absl::string_view kPaths[] = {"grpc", "system_shm",
                                                   "cuda_shm"};
    options_.on_hidden_bytes(kPaths[static_cast<int>(rows->source)],
                             rows->hidden_bytes);
  }
  response->set_request_id(request.request_id());
  response->set_determinism_key((*version)->determinism_key);
  response->set_model((*version)->model);
  response->set_model_version((*version)->version);
  const bool return_lse = rows->return_lse;
  LogpExtras extras;
  extras.entropy = rows->return_entropy;
  extras.top_k = rows->top_k;
  // bf16 rows stay in the request message (no copy); converted rows move
  // into the job.
  const char* hidden = rows->hidden_bf16;
  std::shared_ptr<const void> keep_alive = std::move(request_owner);
  if (rows->region_hold != nullptr) {
    // The region's lease ends when the job does (the request's own bytes
    // are not read).
    keep_alive = std::move(rows->region_hold);
  }
  if (!rows->converted.empty()) {
    auto converted = std::make_shared<const std::vector<uint16_t>>(
        std::move(rows->converted));
    hidden = reinterpret_cast<const char*>(converted->data());
    keep_alive = std::move(converted);
  }
  const bool return_timing = request.return_timing();
  std::shared_ptr<const LogpModel> placed = (*version)->placed;
  *job = std::make_shared<LogpJob>(
      std::move(placed), rows->rows, hidden, std::move(keep_alive),
      std::move(rows->targets), rows->temperature, deadline,
      [this, response, return_lse, extras, return_timing, arrived,
       scheduled = absl::Now(), done = std::move(done),
       version = *std::move(version)](absl::Status status,
                                      LogpJob& job) mutable {
        if (status.ok() && return_timing) {
          FillTiming(job, arrived, scheduled, response->mutable_timing());
        }
        if (status.ok() && options_.on_rows_answered) {
          options_.on_rows_answered(version->model, job.rows());
        }
        if (status.ok()) {
          response->mutable_logprobs()->Add(job.logprobs().begin(),
                                            job.logprobs().end());
          if (return_lse) {
            response->mutable_lse()->Add(job.lse().begin(), job.lse().end());
          }
          if (extras.entropy) {
            response->mutable_entropy()->Add(job.entropy().begin(),
                                             job.entropy().end());
          }
          if (extras.top_k > 0) {
            response->mutable_top_ids()->Add(job.top_ids().begin(),
                                             job.top_ids().end());
            response->mutable_top_logprobs()->Add(job.top_logprobs().begin(),
                                                  job.top_logprobs().end());
          }
        }
        version.reset();  // answered: the version may be freed
        done(std::move(status));
      });
  (*job)->set_extras(extras);
  if (!rows->hidden_pieces.empty()) {
    (*job)->set_hidden_pieces(std::move(rows->hidden_pieces));
  }
  (*job)->set_hidden_location(rows->location);
  // Once scheduled, the job may complete (and its caller go away) at once.
  absl::Status scheduled = batcher_->Schedule(*job);
  if (!scheduled.ok()) job->reset();
  return scheduled;
}

// ---------------------------------------------------------------- wire

namespace {

// A LogProbRequest as gRPC received it: every field but hidden.data parsed,
// the rows left where they arrived (request_wire.h); a message in another
// form is parsed whole (its rows copied).
struct ReceivedRequest {
  std::vector<grpc::Slice> slices;  // what `pieces` point into
  LogProbRequest header;
  std::vector<absl::string_view> pieces;

  const std::vector<absl::string_view>* rows() const {
    // A request with no rows gives no pieces: Submit reads the header.
    return pieces.empty() ? nullptr : &pieces;
  }
};

absl::Status ReadRequest(const grpc::ByteBuffer& bytes,
                         ReceivedRequest* received) {
  // gRPC runs the handler of a call that ended (cancelled, past its
  // deadline) before its message arrived with no message at all.
  if (!bytes.Valid() || !bytes.Dump(&received->slices).ok()) {
    return absl::CancelledError(
        "LogProbRequest: the call ended before its message arrived");
  }
  std::vector<absl::string_view> chunks;
  chunks.reserve(received->slices.size());
  for (const grpc::Slice& slice : received->slices) {
    chunks.emplace_back(reinterpret_cast<const char*>(slice.begin()),
                        slice.size());
  }
  if (auto split = SplitHiddenData(chunks); split.has_value()) {
    received->header = std::move(split->header);
    received->pieces = std::move(split->data);
    return absl::OkStatus();
  }
  received->slices.clear();
  grpc::ByteBuffer whole(bytes);
  const grpc::Status parsed =
      grpc::SerializationTraits<LogProbRequest>::Deserialize(&whole,
                                                             &received->header);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LogProbRequest: not a valid message (", parsed.error_message(), ")"));
  }
  return absl::OkStatus();
}

absl::Status WriteResponse(const LogProbResponse& response,
                           grpc::ByteBuffer* bytes) {
  bool own_buffer = false;
  const grpc::Status written =
      grpc::SerializationTraits<LogProbResponse>::Serialize(response, bytes,
                                                            &own_buffer);
  if (!written.ok()) {
    return absl::InternalError(absl::StrCat(
        "LogProbResponse: cannot be written (", written.error_message(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------- unary

class LogProbServiceImpl::UnaryCall final : public grpc::ServerUnaryReactor {
 public:
  // gRPC keeps *request, and so the slices the rows are read from, alive
  // until OnDone, after the job completed.
  UnaryCall(LogProbServiceImpl* service, grpc::CallbackServerContext* context,
            const grpc::ByteBuffer* request, grpc::ByteBuffer* response)
      : service_(service), response_bytes_(response) {
    absl::Status status = ReadRequest(*request, &request_);
    if (status.ok()) {
      status = service->Submit(
          request_.header, service->CallerOf(*context), nullptr,
          DeadlineOf(context), &response_,
          [this](absl::Status done) { Answer(done); }, &job_, request_.rows());
    }
    // After a successful Submit this object may already be gone.
    if (!status.ok()) {
      Finish(service->Record("ComputeLogProbs", ToGrpcStatus(status, context)));
    }
  }

  void OnCancel() override {
    if (job_ != nullptr) job_->Cancel();
  }
  void OnDone() override { delete this; }

 private:
  void Answer(absl::Status done) {
    if (done.ok()) done = WriteResponse(response_, response_bytes_);
    Finish(service_->Record("ComputeLogProbs", ToGrpcStatus(done)));
  }

  LogProbServiceImpl* const service_;
  grpc::ByteBuffer* const response_bytes_;
  ReceivedRequest request_;
  LogProbResponse response_;
  std::shared_ptr<LogpJob> job_;
};

grpc::ServerUnaryReactor* LogProbServiceImpl::ComputeLogProbs(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  if (grpc::Status denied = Authenticate(*context); !denied.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(Record("ComputeLogProbs", denied));
    return reactor;
  }
  return new UnaryCall(this, context, request, response);
}

// ---------------------------------------------------------------- stream

// Reads requests ahead (up to max_stream_inflight_requests), submits each to
// the batcher at once, and writes answers strictly in request order. The
// stream finishes only when every submitted job has completed, so no job
// callback can outlive the reactor. Requests are read as ComputeLogProbs
// reads its one: the rows gathered from gRPC's received slices.
class LogProbServiceImpl::StreamCall final
    : public LockedReactor<
          grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>> {
 public:
  StreamCall(LogProbServiceImpl* service, grpc::CallbackServerContext* context)
      : service_(service),
        context_(context),
        caller_(service->CallerOf(*context)) {
    absl::MutexLock lock(&mu_);
    StartNextReadLocked();
  }

  void OnReadDone(bool ok) override {
    auto entry = std::make_shared<Entry>();
    std::shared_ptr<grpc::ByteBuffer> bytes;
    bool accepted = false;
    {
      absl::MutexLock lock(&mu_);
      // A read that lands after the stream stopped (Finish may even have
      // been called with this read outstanding) must not start a job whose
      // callback could outlive the reactor. Accepting, and marking this
      // thread as still using the reactor, happen in one critical section.
      accepted = ok && !finished_ && terminal_.ok();
      if (accepted) {
        in_read_callback_ = true;
        pending_.push_back(entry);
        bytes = std::move(next_request_);
      }
    }
    if (!accepted) {
      Update([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        reading_ = false;
        reads_done_ = true;
      });
      return;
    }
    // The job borrows the request's rows; `request` keeps its slices alive.
    auto request = std::make_shared<ReceivedRequest>();
    absl::Status status = ReadRequest(*bytes, request.get());
    bytes.reset();
    std::shared_ptr<LogpJob> job;  // stored under the lock, below
    if (status.ok()) {
      const ReceivedRequest& request_ref = *request;
      status = service_->Submit(
          request_ref.header, caller_, std::move(request), DeadlineOf(context_),
          &entry->response,
          // A raw pointer: the entry owns the job, which owns this callback;
          // pending_ keeps the entry alive until the callback has run.
          [this, raw_entry = entry.get()](absl::Status done) {
            if (done.ok()) {
              done = WriteResponse(raw_entry->response, &raw_entry->bytes);
            }
            Update([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
              raw_entry->status = std::move(done);
              raw_entry->done = true;
            });
          },
          &job, request_ref.rows());
    }
    Update([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      reading_ = false;
      in_read_callback_ = false;
      entry->job = std::move(job);
      if (!terminal_.ok() && entry->job != nullptr) entry->job->Cancel();
      if (!status.ok()) {
        entry->status = status;
        entry->done = true;
      }
    });
  }

  void OnWriteDone(bool ok) override {
    Update([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      writing_ = false;
      pending_.pop_front();
      if (!ok) StopLocked(absl::CancelledError("client went away"));
    });
  }

  void OnCancel() override {
    Update([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      StopLocked(absl::CancelledError("stream cancelled"));
    });
  }

  void OnDone() override { delete this; }

 private:
  struct Entry {
    LogProbResponse response;
    grpc::ByteBuffer bytes;  // the response, written once it is complete
    std::shared_ptr<LogpJob> job;
    absl::Status status;
    bool done = false;
  };

  // Ends the stream early with `status`: reading stops and queued jobs are
  // cancelled (their completions still arrive and are discarded).
  void StopLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!terminal_.ok()) return;
    terminal_ = std::move(status);
    for (const auto& entry : pending_) {
      if (entry->job != nullptr) entry->job->Cancel();
    }
  }

  // Writes the next answer or resumes reading; returns the status to finish
  // with once nothing is left in flight.
  std::optional<grpc::Status> StepLocked() override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return std::nullopt;
    while (!writing_ && !pending_.empty() && pending_.front()->done) {
      Entry& front = *pending_.front();
      if (front.status.ok() && terminal_.ok()) {
        writing_ = true;
        StartWrite(&front.bytes);
        break;
      }
      if (!front.status.ok()) StopLocked(front.status);
      pending_.pop_front();
    }
    const bool stopped = !terminal_.ok();
    if (!reading_ && !reads_done_ && !stopped &&
        static_cast<int>(pending_.size()) <
            service_->options_.max_stream_inflight_requests) {
      StartNextReadLocked();
    }
    if (pending_.empty() && !writing_ && !in_read_callback_ &&
        (reads_done_ || stopped)) {
      finished_ = true;
      return service_->Record("StreamLogProbs",
                              ToGrpcStatus(terminal_, context_));
    }
    return std::nullopt;
  }

  void StartNextReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    reading_ = true;
    next_request_ = std::make_shared<grpc::ByteBuffer>();
    StartRead(next_request_.get());
  }

  LogProbServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  const Caller caller_;

  // Each read lands in a fresh buffer whose slices the job can borrow.
  std::shared_ptr<grpc::ByteBuffer> next_request_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Entry>> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status terminal_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool in_read_callback_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
LogProbServiceImpl::StreamLogProbs(grpc::CallbackServerContext* context) {
  if (grpc::Status denied = Authenticate(*context); !denied.ok()) {
    return new RejectedCall<
        grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>>(
        Record("StreamLogProbs", denied));
  }
  return new StreamCall(this, context);
}

// ---------------------------------------------------------------- info

grpc::ServerUnaryReactor* LogProbServiceImpl::GetModelInfo(
    grpc::CallbackServerContext* context,
    const detlogp::v1::GetModelInfoRequest* request,
    detlogp::v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status denied = Authenticate(*context); !denied.ok()) {
    reactor->Finish(Record("GetModelInfo", denied));
    return reactor;
  }
  auto info = models_->Describe(request->model(), request->model_version());
  if (info.ok()) {
    *response = *std::move(info);
    response->set_max_request_rows(options_.max_request_rows);
    response->set_max_receive_message_bytes(options_.max_receive_message_bytes);
    response->set_max_queue_rows(batcher_->queue_capacity_rows());
  }
  reactor->Finish(Record("GetModelInfo", ToGrpcStatus(info.status())));
  return reactor;
}

}  // namespace detlogp::server
