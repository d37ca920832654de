#include "server/transport/projection_service.h"

#include <grpc/slice.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/projection.h"
#include "server/transport/grpc_status.h"
#include "server/transport/reactor_update.h"
#include "server/transport/rejected_call.h"
#include "proto/status_details.h"

namespace detlogp::server {
namespace {

using detlogp::v1::ProjectRequest;
using detlogp::v1::ProjectResponse;
using kernels::kProjectionInDim;
using kernels::kProjectionOutDim;

constexpr int64_t kRowBytes = kProjectionOutDim * sizeof(float);

// Rows and rows-per-chunk of a valid request, or INVALID_ARGUMENT.
absl::Status ValidateProjectRequest(const ProjectRequest& request,
                                    int64_t max_rows_per_chunk) {
  const detlogp::v1::Tensor& x = request.x();
  if (x.dtype() != detlogp::v1::DTYPE_FLOAT32) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "x.dtype",
                          absl::StrCat(x.dtype(), " is not DTYPE_FLOAT32"));
  }
  if (x.shape_size() != 2 || x.shape(1) != kProjectionInDim || x.shape(0) < 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "x.shape",
                          absl::StrCat("expected [R, ", kProjectionInDim, "]"));
  }
  if (static_cast<int64_t>(x.data().size()) !=
      x.shape(0) * kProjectionInDim * static_cast<int64_t>(sizeof(float))) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "x.data",
        absl::StrCat(x.data().size(), " bytes, expected R*96*4 = ",
                     x.shape(0) * kProjectionInDim * 4));
  }
  if (request.rows_per_chunk() < 0 ||
      request.rows_per_chunk() > max_rows_per_chunk) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "rows_per_chunk",
        absl::StrCat(request.rows_per_chunk(), " is outside [0, ",
                     max_rows_per_chunk, "] (0 lets the server choose)"));
  }
  return absl::OkStatus();
}

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Key of a length-delimited field (wire type 2).
void AppendBytesFieldKey(int field_number, std::string* out) {
  AppendVarint((static_cast<uint64_t>(field_number) << 3) | 2, out);
}

// The wire bytes of a ProjectResponse up to (not including) y.data's
// contents: request_id, row_offset, y's key and length, y.dtype, y.shape and
// y.data's key and length. The `data_bytes` bytes of Y follow, then
// ResponseTail. Together they are exactly what ProjectResponse's own
// serialisation gives (fields in number order).
std::string ResponseHead(const std::string& request_id, int64_t row_offset,
                         int64_t rows) {
  const uint64_t data_bytes = static_cast<uint64_t>(rows * kRowBytes);
  detlogp::v1::Tensor y;
  y.set_dtype(detlogp::v1::DTYPE_FLOAT32);
  y.add_shape(rows);
  y.add_shape(kProjectionOutDim);
  std::string y_head = y.SerializeAsString();
  AppendBytesFieldKey(detlogp::v1::Tensor::kDataFieldNumber, &y_head);
  AppendVarint(data_bytes, &y_head);
  ProjectResponse response;
  response.set_request_id(request_id);
  response.set_row_offset(row_offset);
  std::string head = response.SerializeAsString();
  AppendBytesFieldKey(ProjectResponse::kYFieldNumber, &head);
  AppendVarint(y_head.size() + data_bytes, &head);
  head += y_head;
  return head;
}

// The fields after y (the determinism key), the same for every chunk.
std::string ResponseTail(const std::string& determinism_key) {
  ProjectResponse response;
  response.set_determinism_key(determinism_key);
  return response.SerializeAsString();
}

// One chunk's output, lent to gRPC as the y.data slice of a response: the
// slice holds a reference, and `lent` stays true until gRPC drops it (after
// the bytes went to the socket), so a buffer is refilled only once gRPC is
// done reading it. Its memory goes back to its pool when the last reference
// goes (the pool stays alive for it, even after the service).
class ChunkBuffer {
 public:
  explicit ChunkBuffer(HostBuffer memory) : memory_(std::move(memory)) {}
  ChunkBuffer(const ChunkBuffer&) = delete;
  ChunkBuffer& operator=(const ChunkBuffer&) = delete;

  char* data() { return memory_.data(); }
  int64_t bytes() const { return static_cast<int64_t>(memory_.bytes()); }
  bool lent() const { return lent_.load(std::memory_order_acquire); }

  // A slice over the first `bytes` of `buffer`.
  static grpc::Slice Lend(std::shared_ptr<ChunkBuffer> buffer, int64_t bytes) {
    buffer->lent_.store(true, std::memory_order_relaxed);
    char* data = buffer->data();
    auto* ref = new std::shared_ptr<ChunkBuffer>(std::move(buffer));
    return grpc::Slice(
        grpc_slice_new_with_user_data(data, static_cast<size_t>(bytes),
                                      &ChunkBuffer::Return, ref),
        grpc::Slice::STEAL_REF);
  }

 private:
  static void Return(void* ref) {
    auto* buffer = static_cast<std::shared_ptr<ChunkBuffer>*>(ref);
    (*buffer)->lent_.store(false, std::memory_order_release);
    delete buffer;
  }

  const HostBuffer memory_;  // left uninitialised: Y overwrites it
  std::atomic<bool> lent_{false};
};

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

// A ring of slots: chunk c is computed into slot c % slots and written from
// it; a slot is refilled with chunk c + slots once chunk c's write is done.
// Finish comes only when no computation is in flight, so no scheduler
// callback can outlive the reactor.
class ProjectionServiceImpl::ProjectCall final
    : public LockedReactor<grpc::ServerWriteReactor<grpc::ByteBuffer>> {
 public:
  ProjectCall(ProjectionServiceImpl* service,
              const grpc::ByteBuffer& request_bytes)
      : service_(service) {
    absl::Status valid = ParseRequest(request_bytes);
    if (valid.ok()) {
      valid = ValidateProjectRequest(
          request_, service->scheduler_->options().max_launch_rows);
    }
    UpdateAndWrite([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (!valid.ok()) {
        status_ = valid;
        return;
      }
      validated_ = true;
      rows_ = request_.x().shape(0);
      chunk_rows_ =
          request_.rows_per_chunk() > 0
              ? request_.rows_per_chunk()
              : std::min(service->options_.default_rows_per_chunk,
                         service->scheduler_->options().max_launch_rows);
      const int64_t chunk_bytes = chunk_rows_ * kRowBytes;
      const int64_t fit =
          service->options_.max_stream_buffer_bytes / chunk_bytes;
      slots_.resize(static_cast<size_t>(std::max<int64_t>(
          1, std::min(num_chunks(), std::max<int64_t>(2, fit)))));
      tail_ = ResponseTail(service->options_.determinism_key);
      idle_since_ = absl::Now();
      for (Slot& slot : slots_) StartComputeLocked(&slot);
    });
  }

  void OnWriteDone(bool ok) override {
    UpdateAndWrite([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      const absl::Time now = absl::Now();
      timings_.write_seconds += Seconds(now - write_start_);
      idle_since_ = now;
      writing_ = false;
      Slot& written = slots_[next_write_ % slots_.size()];
      written.ready = false;
      written.message.Clear();
      ++next_write_;
      ++timings_.chunks;
      if (!ok) {
        if (status_.ok()) status_ = absl::CancelledError("client went away");
      } else {
        StartComputeLocked(&written);
      }
    });
  }

  void OnCancel() override {
    UpdateAndWrite([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (status_.ok()) status_ = absl::CancelledError("stream cancelled");
    });
  }

  void OnDone() override {
    if (validated_ && service_->options_.on_stream_timings) {
      service_->options_.on_stream_timings(timings_);
    }
    delete this;
  }

 private:
  struct Slot {
    std::shared_ptr<ChunkBuffer> buffer;
    grpc::ByteBuffer message;  // head, the buffer's bytes, tail
    int64_t chunk = -1;        // which chunk it holds
    bool computing = false;
    bool ready = false;
  };

  // Parses the request, then drops gRPC's bytes of it: a video's X (140 MB)
  // is held once, in request_, not twice until the stream ends. gRPC made
  // the ByteBuffer non-const and destroys it at the end of the call, which
  // is safe on an empty one.
  absl::Status ParseRequest(const grpc::ByteBuffer& bytes) {
    grpc::ByteBuffer& received = const_cast<grpc::ByteBuffer&>(bytes);
    bool parsed = false;
    {
      grpc::ProtoBufferReader reader(&received);
      parsed = request_.ParseFromZeroCopyStream(&reader);
    }
    received.Clear();
    if (!parsed)
      return absl::InvalidArgumentError("ProjectRequest does not parse");
    return absl::OkStatus();
  }

  int64_t num_chunks() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return (rows_ + chunk_rows_ - 1) / chunk_rows_;
  }

  void StartComputeLocked(Slot* slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!status_.ok() || next_compute_ >= num_chunks()) return;
    const int64_t chunk = next_compute_++;
    const int64_t first = chunk * chunk_rows_;
    const int64_t rows = std::min(chunk_rows_, rows_ - first);
    // A buffer gRPC still reads from (its write is done, the socket has not
    // taken every byte yet) is left to gRPC, which returns it to the pool
    // when done; rare.
    if (slot->buffer == nullptr || slot->buffer->lent()) {
      slot->buffer =
          std::make_shared<ChunkBuffer>(service_->chunk_buffers_->Acquire(
              static_cast<size_t>(chunk_rows_ * kRowBytes)));
      ++timings_.buffers_allocated;
    }
    slot->chunk = chunk;
    slot->computing = true;
    int64_t buffered = 0;
    for (const Slot& s : slots_) buffered += s.computing || s.ready ? 1 : 0;
    timings_.most_chunks_buffered =
        std::max(timings_.most_chunks_buffered, buffered);
    ProjectionScheduler::Chunk work;
    work.x = reinterpret_cast<const float*>(request_.x().data().data()) +
             first * kProjectionInDim;
    work.y = reinterpret_cast<float*>(slot->buffer->data());
    work.rows = rows;
    work.done = [this, slot, first, rows](absl::Status status) {
      // Built outside the lock: the slot is this computation's alone until
      // `computing` goes false.
      if (status.ok()) {
        grpc::Slice parts[3] = {
            grpc::Slice(ResponseHead(request_.request_id(), first, rows)),
            ChunkBuffer::Lend(slot->buffer, rows * kRowBytes),
            grpc::Slice(tail_)};
        slot->message = grpc::ByteBuffer(parts, 3);
      }
      UpdateAndWrite([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        slot->computing = false;
        slot->ready = status.ok();
        if (!status.ok() && status_.ok()) status_ = status;
      });
    };
    if (absl::Status s = service_->scheduler_->Schedule(std::move(work));
        !s.ok()) {
      slot->computing = false;
      status_ = s;
    }
  }

  // Starts the next write when its chunk is ready; returns the status to
  // finish with once nothing is in flight.
  std::optional<grpc::Status> StepLocked() override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return std::nullopt;
    bool computing = false;
    for (const Slot& slot : slots_) computing = computing || slot.computing;
    const bool done = !status_.ok() ? !computing && !writing_
                                    : next_write_ == num_chunks() && !writing_;
    if (done) {
      finished_ = true;
      const grpc::Status status = ToGrpcStatus(status_);
      if (service_->options_.on_call_done) {
        service_->options_.on_call_done("Project", status.error_code());
      }
      return status;
    }
    if (!status_.ok() || next_write_ == num_chunks()) return std::nullopt;
    Slot& next = slots_[next_write_ % slots_.size()];
    if (!writing_ && next.ready && next.chunk == next_write_) {
      writing_ = true;
      write_start_ = absl::Now();
      timings_.waited_for_compute_seconds +=
          Seconds(write_start_ - idle_since_);
      write_to_start_ = &next.message;
    }
    return std::nullopt;
  }

  // LockedReactor::Update, except that a write StepLocked chose starts after
  // the lock is released: StartWrite sends inline (a socket buffer's worth,
  // ~1 ms for MBs), and a scheduler thread reporting a computed chunk must
  // not wait that long for the lock. Safe: while writing_ is set nothing
  // finishes the call, and writing_ stays set until OnWriteDone, which only
  // this StartWrite can cause; `this` is not touched after it.
  template <typename Mutate>
  void UpdateAndWrite(Mutate&& mutate) {
    std::optional<grpc::Status> status;
    grpc::ByteBuffer* write = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mutate();
      status = StepLocked();
      write = std::exchange(write_to_start_, nullptr);
    }
    if (write != nullptr) {
      StartWrite(write);
    } else if (status.has_value()) {
      Finish(*std::move(status));
    }
  }

  ProjectionServiceImpl* const service_;
  ProjectRequest request_;  // parsed before any computation, then read-only
  std::string tail_;        // ResponseTail, set before any computation
  bool validated_ = false;  // read in OnDone, after every other callback
  int64_t rows_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t chunk_rows_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_compute_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_write_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);  // sized once, never resized
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  // Set by StepLocked, started by UpdateAndWrite once the lock is released.
  grpc::ByteBuffer* write_to_start_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Time idle_since_ ABSL_GUARDED_BY(mu_);
  absl::Time write_start_ ABSL_GUARDED_BY(mu_);
  StreamTimings timings_;  // under mu_; read in OnDone
};

ProjectionServiceImpl::ProjectionServiceImpl(const Options& options,
                                             ProjectionScheduler* scheduler)
    : options_(options),
      scheduler_(scheduler),
      chunk_buffers_(options.chunk_buffers != nullptr
                         ? options.chunk_buffers
                         : NewHeapHostBufferPool()) {}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ProjectionServiceImpl::Project(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  if (options_.authenticator != nullptr) {
    if (absl::Status denied = options_.authenticator->Check(*context);
        !denied.ok()) {
      const grpc::Status status = ToGrpcStatus(denied);
      if (options_.on_call_done)
        options_.on_call_done("Project", status.error_code());
      return new RejectedCall<grpc::ServerWriteReactor<grpc::ByteBuffer>>(
          status);
    }
  }
  return new ProjectCall(this, *request);
}

}  // namespace detlogp::server
