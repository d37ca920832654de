#include "server/batching/projection_scheduler.h"

#include <cstring>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "kernels/projection.h"

namespace detlogp::server {

using kernels::kProjectionInDim;
using kernels::kProjectionOutDim;

absl::StatusOr<std::unique_ptr<ProjectionScheduler>> ProjectionScheduler::Create(
    const Options& options, ProjectionBackend* backend) {
  if (options.max_launch_rows <= 0 || options.num_threads <= 0 || backend == nullptr) {
    return absl::InvalidArgumentError(
        "projection scheduler: max_launch_rows and num_threads must be > 0");
  }
  std::vector<std::unique_ptr<ProjectionExecutor>> executors;
  for (int i = 0; i < options.num_threads; ++i) {
    auto executor = backend->NewExecutor(options.max_launch_rows);
    if (!executor.ok()) return executor.status();
    executors.push_back(*std::move(executor));
  }
  return absl::WrapUnique(new ProjectionScheduler(options, std::move(executors)));
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
    return absl::InvalidArgumentError(absl::StrCat(
        "projection chunk of ", chunk.rows, " rows; expected 1..",
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
    int64_t offset = 0;
    for (const Chunk& chunk : launch) {
      std::memcpy(staging.x + offset * kProjectionInDim, chunk.x,
                  chunk.rows * kProjectionInDim * sizeof(float));
      offset += chunk.rows;
    }
    const absl::Status status = executor->Run(rows);
    const absl::Time ran = absl::Now();
    absl::Duration copy_out;
    offset = 0;
    for (Chunk& chunk : launch) {
      if (status.ok()) {
        const absl::Time start = absl::Now();
        std::memcpy(chunk.y, staging.y + offset * kProjectionOutDim,
                    chunk.rows * kProjectionOutDim * sizeof(float));
        copy_out += absl::Now() - start;
      }
      offset += chunk.rows;
      chunk.done(status);
    }
    if (options_.on_launch) {
      options_.on_launch({rows, absl::ToDoubleSeconds(taken - oldest),
                          absl::ToDoubleSeconds(ran - taken),
                          absl::ToDoubleSeconds(copy_out)});
    }
  }
}

}  // namespace detlogp::server
