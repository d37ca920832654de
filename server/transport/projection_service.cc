#include "server/transport/projection_service.h"

#include <algorithm>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/projection.h"
#include "server/transport/grpc_status.h"
#include "server/transport/reactor_update.h"
#include "server/transport/rejected_call.h"

namespace detlogp::server {
namespace {

using detlogp::v1::ProjectRequest;
using detlogp::v1::ProjectResponse;
using kernels::kProjectionInDim;
using kernels::kProjectionOutDim;

// Rows and rows-per-chunk of a valid request, or INVALID_ARGUMENT.
absl::Status ValidateProjectRequest(const ProjectRequest& request,
                                    int64_t max_rows_per_chunk) {
  const detlogp::v1::Tensor& x = request.x();
  if (x.dtype() != detlogp::v1::DTYPE_FLOAT32) {
    return absl::InvalidArgumentError(
        absl::StrCat("x.dtype: ", x.dtype(), " is not DTYPE_FLOAT32"));
  }
  if (x.shape_size() != 2 || x.shape(1) != kProjectionInDim || x.shape(0) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("x.shape: expected [R, ", kProjectionInDim, "]"));
  }
  if (static_cast<int64_t>(x.data().size()) !=
      x.shape(0) * kProjectionInDim * static_cast<int64_t>(sizeof(float))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x.data: ", x.data().size(), " bytes, expected R*96*4 = ",
        x.shape(0) * kProjectionInDim * 4));
  }
  if (request.rows_per_chunk() < 0 || request.rows_per_chunk() > max_rows_per_chunk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows_per_chunk: ", request.rows_per_chunk(), " is outside [0, ",
        max_rows_per_chunk, "] (0 lets the server choose)"));
  }
  return absl::OkStatus();
}

}  // namespace

// Two slots alternate: while chunk i is written from one, chunk i+1 is
// computed into the other. Finish comes only when no computation is in
// flight, so no scheduler callback can outlive the reactor.
class ProjectionServiceImpl::ProjectCall final
    : public LockedReactor<grpc::ServerWriteReactor<ProjectResponse>> {
 public:
  ProjectCall(ProjectionServiceImpl* service, const ProjectRequest* request)
      : service_(service), request_(request) {
    const absl::Status valid = ValidateProjectRequest(
        *request, service->scheduler_->options().max_launch_rows);
    Update([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (!valid.ok()) {
        status_ = valid;
        return;
      }
      rows_ = request->x().shape(0);
      chunk_rows_ = request->rows_per_chunk() > 0
                        ? request->rows_per_chunk()
                        : std::min(service->options_.default_rows_per_chunk,
                                   service->scheduler_->options().max_launch_rows);
      for (Slot& slot : slots_) StartComputeLocked(&slot);
    });
  }

  void OnWriteDone(bool ok) override {
    Update([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      writing_ = false;
      Slot& written = slots_[next_write_ % 2];
      written.ready = false;
      written.response.Clear();
      ++next_write_;
      if (!ok) {
        if (status_.ok()) status_ = absl::CancelledError("client went away");
      } else {
        StartComputeLocked(&written);
      }
    });
  }

  void OnCancel() override {
    Update([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (status_.ok()) status_ = absl::CancelledError("stream cancelled");
    });
  }

  void OnDone() override { delete this; }

 private:
  struct Slot {
    ProjectResponse response;
    int64_t chunk = -1;   // which chunk it holds
    bool computing = false;
    bool ready = false;
  };

  int64_t num_chunks() const { return (rows_ + chunk_rows_ - 1) / chunk_rows_; }

  void StartComputeLocked(Slot* slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!status_.ok() || next_compute_ >= num_chunks()) return;
    const int64_t chunk = next_compute_++;
    const int64_t first = chunk * chunk_rows_;
    const int64_t rows = std::min(chunk_rows_, rows_ - first);
    slot->chunk = chunk;
    slot->computing = true;
    ProjectResponse& response = slot->response;
    response.set_request_id(request_->request_id());
    response.set_row_offset(first);
    response.set_determinism_key(service_->options_.determinism_key);
    detlogp::v1::Tensor* y = response.mutable_y();
    y->set_dtype(detlogp::v1::DTYPE_FLOAT32);
    y->add_shape(rows);
    y->add_shape(kProjectionOutDim);
    y->mutable_data()->resize(rows * kProjectionOutDim * sizeof(float));
    ProjectionScheduler::Chunk work;
    work.x = reinterpret_cast<const float*>(request_->x().data().data()) +
             first * kProjectionInDim;
    work.y = reinterpret_cast<float*>(y->mutable_data()->data());
    work.rows = rows;
    work.done = [this, slot](absl::Status status) {
      Update([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        slot->computing = false;
        slot->ready = status.ok();
        if (!status.ok() && status_.ok()) status_ = status;
      });
    };
    if (absl::Status s = service_->scheduler_->Schedule(std::move(work)); !s.ok()) {
      slot->computing = false;
      status_ = s;
    }
  }

  // Starts the next write when its chunk is ready; returns the status to
  // finish with once nothing is in flight.
  std::optional<grpc::Status> StepLocked() override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return std::nullopt;
    const bool computing = slots_[0].computing || slots_[1].computing;
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
    Slot& next = slots_[next_write_ % 2];
    if (!writing_ && next.ready && next.chunk == next_write_) {
      writing_ = true;
      StartWrite(&next.response);
    }
    return std::nullopt;
  }

  ProjectionServiceImpl* const service_;
  const ProjectRequest* const request_;  // gRPC keeps it until OnDone
  int64_t rows_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t chunk_rows_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_compute_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_write_ ABSL_GUARDED_BY(mu_) = 0;
  Slot slots_[2] ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

ProjectionServiceImpl::ProjectionServiceImpl(const Options& options,
                                             ProjectionScheduler* scheduler)
    : options_(options), scheduler_(scheduler) {}

grpc::ServerWriteReactor<ProjectResponse>* ProjectionServiceImpl::Project(
    grpc::CallbackServerContext* context, const ProjectRequest* request) {
  if (options_.authenticator != nullptr) {
    if (absl::Status denied = options_.authenticator->Check(*context); !denied.ok()) {
      const grpc::Status status = ToGrpcStatus(denied);
      if (options_.on_call_done) options_.on_call_done("Project", status.error_code());
      return new RejectedCall<grpc::ServerWriteReactor<ProjectResponse>>(status);
    }
  }
  return new ProjectCall(this, request);
}

}  // namespace detlogp::server
