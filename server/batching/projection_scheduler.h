// Runs projection chunks from every stream on the projection backend's
// executors. Chunks queued together share one launch (up to
// max_launch_rows rows): each row's bits are independent of its neighbours,
// so pooling changes speed only. A launch copies its chunks' X into the
// executor's staging and hands the executor each chunk's y as that piece's
// destination: the CUDA executor copies Y from the device straight into it
// (the chunk buffers are its backend's pinned memory), so no pass over Y
// runs on the host; the CPU executor computes into staging and copies.
#ifndef DETLOGP_SERVER_BATCHING_PROJECTION_SCHEDULER_H_
#define DETLOGP_SERVER_BATCHING_PROJECTION_SCHEDULER_H_

#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backends/projection_backend.h"

namespace detlogp::server {

class ProjectionScheduler {
 public:
  // Where one launch's time went (on_launch; the server's metrics).
  struct LaunchTimings {
    int64_t rows = 0;
    double queue_delay_seconds = 0;  // its oldest chunk, scheduled to taken
    double run_seconds = 0;          // copying X in and the backend's Run,
                                     // less copy_out_seconds
    double copy_out_seconds = 0;     // Y copied on the host from the
                                     // executor's staging into the chunks
                                     // (~0 when the device wrote them)
  };

  struct Options {
    int64_t max_launch_rows = 2048;  // rows per backend launch
    int num_threads = 1;             // launches in flight
    // Called on the launching thread after each launch's run and before its
    // chunks' `done`: a stream that finishes on them finds them counted.
    std::function<void(const LaunchTimings&)> on_launch;
  };

  // Rows [0, rows) of x ([rows, 96]) projected into y ([rows, 5376]); both
  // stay valid until `done` runs. y from the backend's host_buffer_pool()
  // takes the backend's fastest path.
  struct Chunk {
    const float* x = nullptr;
    float* y = nullptr;
    int64_t rows = 0;
    absl::AnyInvocable<void(absl::Status)> done;
  };

  static absl::StatusOr<std::unique_ptr<ProjectionScheduler>> Create(
      const Options& options, ProjectionBackend* backend);
  ~ProjectionScheduler();
  ProjectionScheduler(const ProjectionScheduler&) = delete;
  ProjectionScheduler& operator=(const ProjectionScheduler&) = delete;

  // INVALID_ARGUMENT for chunks over max_launch_rows, UNAVAILABLE once
  // stopping. On OK, `done` runs exactly once, on a scheduler thread.
  absl::Status Schedule(Chunk chunk);

  // Runs what is queued, then joins.
  void Stop();

  const Options& options() const { return options_; }

 private:
  ProjectionScheduler(
      const Options& options,
      std::vector<std::unique_ptr<ProjectionExecutor>> executors);
  void Loop(ProjectionExecutor* executor);
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }

  struct Queued {
    Chunk chunk;
    absl::Time scheduled;
  };

  const Options options_;
  std::vector<std::unique_ptr<ProjectionExecutor>> executors_;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BATCHING_PROJECTION_SCHEDULER_H_
