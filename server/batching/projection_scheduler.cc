#include "server/batching/projection_scheduler.h"

#include <algorithm>
#include <cstring>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "kernels/projection.h"

namespace detlogp::server {

using kernels::kProjectionInDim;

absl::StatusOr<std::unique_ptr<ProjectionScheduler>>
ProjectionScheduler::Create(const Options& options,
                            ProjectionBackend* backend) {
  if (options.max_launch_rows <= 0 || options.num_threads <= 0 ||
      backend == nullptr) {
    return absl::InvalidArgumentError(
        "projection scheduler: max_launch_rows and num_threads must be > 0");
  }
  std::vector<std::unique_ptr<ProjectionExecutor>> executors;
  for (int i = 0; i < options.num_threads; ++i) {
    auto executor = backend->NewExecutor(options.max_launch_rows);
    if (!executor.ok()) return executor.status();
    executors.push_back(*std::move(executor));
  }
  return absl::WrapUnique(
      new ProjectionScheduler(options, std::move(executors)));
}

ProjectionScheduler::ProjectionScheduler(
    const Options& options,
    std::vector<std::unique_ptr<ProjectionExecutor>> executors)
    : options_(options), executors_(std::move(executors)) {
  for (auto& executor : executors_) {
    threads_.emplace_back([this, e = executor.get()] { Loop(e); });
  }
}

ProjectionScheduler::~ProjectionScheduler() { Stop(); }

absl::Status ProjectionScheduler::Schedule(Chunk chunk) {
  if (chunk.rows <= 0 || chunk.rows > options_.max_launch_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("projection chunk of ", chunk.rows, " rows; expected 1..",
                     options_.max_launch_rows));
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  queue_.push_back({std::move(chunk), absl::Now()});
  return absl::OkStatus();
}

void ProjectionScheduler::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
}

void ProjectionScheduler::Loop(ProjectionExecutor* executor) {
  const ProjectionStaging staging = executor->staging();
  while (true) {
    std::vector<Chunk> launch;
    int64_t rows = 0;
    absl::Time oldest;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &ProjectionScheduler::HasWorkOrStopping));
      if (queue_.empty()) return;  // stopping
      oldest = queue_.front().scheduled;
      while (!queue_.empty() &&
             rows + queue_.front().chunk.rows <= options_.max_launch_rows) {
        rows += queue_.front().chunk.rows;
        launch.push_back(std::move(queue_.front().chunk));
        queue_.pop_front();
      }
    }
    const absl::Time taken = absl::Now();
    std::vector<YDestination> outputs;
    outputs.reserve(launch.size());
    int64_t offset = 0;
    for (const Chunk& chunk : launch) {
      std::memcpy(staging.x + offset * kProjectionInDim, chunk.x,
                  chunk.rows * kProjectionInDim * sizeof(float));
      outputs.push_back({chunk.y, chunk.rows});
      offset += chunk.rows;
    }
    ProjectionRunStats stats;
    const absl::Status status = executor->Run(rows, outputs, &stats);
    const absl::Time ran = absl::Now();
    // The launch is counted before its chunks complete: a stream that
    // finishes on them may be counted (and scraped) at once, and its
    // launches must already be there.
    if (options_.on_launch) {
      // Run's time less its host copy-out, so run_seconds means what it
      // did when the scheduler did the copy.
      const double run = absl::ToDoubleSeconds(ran - taken);
      options_.on_launch({rows, absl::ToDoubleSeconds(taken - oldest),
                          std::max(0.0, run - stats.copy_out_seconds),
                          stats.copy_out_seconds});
    }
    for (Chunk& chunk : launch) chunk.done(status);
  }
}

}  // namespace detlogp::server
