// ProjectionScheduler pools chunks of different streams into one launch and
// scatters each chunk's rows back, with a fake backend that records launches.
#include "server/batching/projection_scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "kernels/projection.h"

namespace detlogp::server {
namespace {

using kernels::kProjectionInDim;
using kernels::kProjectionOutDim;

// y[r][o] = x[r][0] + o; launches recorded; the first launch can be held.
class FakeProjectionBackend final : public ProjectionBackend {
 public:
  FakeProjectionBackend() { description_.name = "fake"; }
  const BackendDescription& description() const override { return description_; }
  absl::StatusOr<std::unique_ptr<ProjectionExecutor>> NewExecutor(
      int64_t max_rows) override {
    return std::unique_ptr<ProjectionExecutor>(new Executor(this, max_rows));
  }
  std::vector<int64_t> launches() {
    absl::MutexLock lock(&mu_);
    return launches_;
  }
  absl::Notification release_first;

 private:
  class Executor final : public ProjectionExecutor {
   public:
    Executor(FakeProjectionBackend* backend, int64_t rows)
        : backend_(backend), x_(rows * kProjectionInDim), y_(rows * kProjectionOutDim) {}
    ProjectionStaging staging() override {
      return {static_cast<int64_t>(x_.size() / kProjectionInDim), x_.data(), y_.data()};
    }
    absl::Status Run(int64_t rows) override {
      if (backend_->first_.exchange(false)) backend_->release_first.WaitForNotification();
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = 0; o < kProjectionOutDim; ++o) {
          y_[r * kProjectionOutDim + o] = x_[r * kProjectionInDim] + static_cast<float>(o);
        }
      }
      absl::MutexLock lock(&backend_->mu_);
      backend_->launches_.push_back(rows);
      return absl::OkStatus();
    }

   private:
    FakeProjectionBackend* backend_;
    std::vector<float> x_, y_;
  };

  BackendDescription description_;
  std::atomic<bool> first_{true};
  absl::Mutex mu_;
  std::vector<int64_t> launches_ ABSL_GUARDED_BY(mu_);
};

TEST(ProjectionSchedulerTest, ChunksOfDifferentStreamsShareALaunch) {
  FakeProjectionBackend backend;
  auto scheduler = *ProjectionScheduler::Create({64, 1}, &backend);
  // Chunk A occupies the only executor; B, C and D queue and then share one
  // launch (5 + 7 + 9 = 21 rows <= 64).
  const std::vector<int64_t> sizes = {3, 5, 7, 9};
  std::vector<std::vector<float>> xs, ys;
  for (size_t i = 0; i < sizes.size(); ++i) {
    xs.emplace_back(sizes[i] * kProjectionInDim);
    ys.emplace_back(sizes[i] * kProjectionOutDim, -1.0f);
    for (int64_t r = 0; r < sizes[i]; ++r) xs[i][r * kProjectionInDim] = 100.0f * i + r;
  }
  std::atomic<int> done{0};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ProjectionScheduler::Chunk chunk;
    chunk.x = xs[i].data();
    chunk.y = ys[i].data();
    chunk.rows = sizes[i];
    chunk.done = [&](absl::Status s) {
      EXPECT_TRUE(s.ok());
      ++done;
    };
    ASSERT_TRUE(scheduler->Schedule(std::move(chunk)).ok());
    if (i == 0) absl::SleepFor(absl::Milliseconds(50));  // A is running
  }
  absl::SleepFor(absl::Milliseconds(20));
  backend.release_first.Notify();
  scheduler->Stop();
  EXPECT_EQ(done.load(), 4);
  EXPECT_EQ(backend.launches(), (std::vector<int64_t>{3, 21}));
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t r = 0; r < sizes[i]; ++r) {
      EXPECT_EQ(ys[i][r * kProjectionOutDim + 5], 100.0f * i + r + 5) << i << "," << r;
    }
  }
  // Chunks larger than a launch are refused with a status.
  ProjectionScheduler::Chunk huge;
  huge.rows = 65;
  EXPECT_EQ(scheduler->Schedule(std::move(huge)).code(),
            absl::StatusCode::kInvalidArgument);
}

// on_launch reports each launch once its chunks are done: its rows, how long
// its oldest chunk waited, the backend's run and the copy out.
TEST(ProjectionSchedulerTest, LaunchTimingsSayWhereTheTimeWent) {
  FakeProjectionBackend backend;
  absl::Mutex mu;
  std::vector<ProjectionScheduler::LaunchTimings> timings;
  ProjectionScheduler::Options options;
  options.max_launch_rows = 64;
  options.num_threads = 1;
  options.on_launch = [&](const ProjectionScheduler::LaunchTimings& t) {
    absl::MutexLock lock(&mu);
    timings.push_back(t);
  };
  auto scheduler = *ProjectionScheduler::Create(options, &backend);
  std::vector<float> x(8 * kProjectionInDim, 1.0f), y(8 * kProjectionOutDim);
  for (int i = 0; i < 2; ++i) {
    ProjectionScheduler::Chunk chunk;
    chunk.x = x.data() + i * 4 * kProjectionInDim;
    chunk.y = y.data() + i * 4 * kProjectionOutDim;
    chunk.rows = 4;
    chunk.done = [](absl::Status s) { EXPECT_TRUE(s.ok()); };
    ASSERT_TRUE(scheduler->Schedule(std::move(chunk)).ok());
    // The first launch runs (held) while the second chunk waits.
    if (i == 0) absl::SleepFor(absl::Milliseconds(20));
  }
  absl::SleepFor(absl::Milliseconds(60));
  backend.release_first.Notify();
  scheduler->Stop();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(timings.size(), 2u);
  EXPECT_EQ(timings[0].rows, 4);
  EXPECT_EQ(timings[1].rows, 4);
  EXPECT_GE(timings[0].run_seconds, 0.07);           // held 20 + 60 ms
  EXPECT_GE(timings[1].queue_delay_seconds, 0.05);   // behind the held launch
  EXPECT_LT(timings[0].queue_delay_seconds, timings[1].queue_delay_seconds);
  EXPECT_LT(timings[1].run_seconds, timings[0].run_seconds);
  EXPECT_GE(timings[1].copy_out_seconds, 0.0);
}

}  // namespace
}  // namespace detlogp::server
