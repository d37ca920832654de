// ProjectionScheduler pools chunks of different streams into one launch and
// hands the executor each chunk's own destination, with a fake backend that
// records launches and the destinations it was given.
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

// y[r][o] = x[r][0] + o, written straight into each destination; launches
// and their destinations recorded; the first launch can be held; each Run
// reports copy_out_seconds of `copy_out_seconds`.
class FakeProjectionBackend final : public ProjectionBackend {
 public:
  FakeProjectionBackend() { description_.name = "fake"; }
  const BackendDescription& description() const override {
    return description_;
  }
  absl::StatusOr<std::unique_ptr<ProjectionExecutor>> NewExecutor(
      int64_t max_rows) override {
    return std::unique_ptr<ProjectionExecutor>(new Executor(this, max_rows));
  }
  std::vector<int64_t> launches() {
    absl::MutexLock lock(&mu_);
    return launches_;
  }
  std::vector<std::vector<YDestination>> destinations() {
    absl::MutexLock lock(&mu_);
    return destinations_;
  }
  absl::Notification release_first;
  double copy_out_seconds = 0;

 private:
  class Executor final : public ProjectionExecutor {
   public:
    Executor(FakeProjectionBackend* backend, int64_t rows)
        : backend_(backend), x_(rows * kProjectionInDim) {}
    ProjectionStaging staging() override {
      return {static_cast<int64_t>(x_.size() / kProjectionInDim), x_.data()};
    }
    absl::Status Run(int64_t rows, absl::Span<const YDestination> outputs,
                     ProjectionRunStats* stats) override {
      if (backend_->first_.exchange(false))
        backend_->release_first.WaitForNotification();
      if (absl::Status s =
              CheckLaunch(rows, x_.size() / kProjectionInDim, outputs);
          !s.ok()) {
        return s;
      }
      const float* x = x_.data();
      for (const YDestination& output : outputs) {
        for (int64_t r = 0; r < output.rows; ++r, x += kProjectionInDim) {
          for (int64_t o = 0; o < kProjectionOutDim; ++o) {
            output.y[r * kProjectionOutDim + o] = x[0] + static_cast<float>(o);
          }
        }
      }
      // As if copying out: the time passes, and is reported.
      absl::SleepFor(absl::Seconds(backend_->copy_out_seconds));
      stats->copy_out_seconds = backend_->copy_out_seconds;
      absl::MutexLock lock(&backend_->mu_);
      backend_->launches_.push_back(rows);
      backend_->destinations_.emplace_back(outputs.begin(), outputs.end());
      return absl::OkStatus();
    }

   private:
    FakeProjectionBackend* backend_;
    std::vector<float> x_;
  };

  BackendDescription description_;
  std::atomic<bool> first_{true};
  absl::Mutex mu_;
  std::vector<int64_t> launches_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<YDestination>> destinations_ ABSL_GUARDED_BY(mu_);
};

// Schedules chunk i (rows sizes[i], X xs[i], Y ys[i]) for every i: the
// first holds the backend's only executor until the rest have queued behind
// it, then runs out. Returns how many chunks finished OK.
int ScheduleBehindFirst(FakeProjectionBackend* backend,
                        ProjectionScheduler* scheduler,
                        const std::vector<int64_t>& sizes,
                        const std::vector<std::vector<float>>& xs,
                        std::vector<std::vector<float>>& ys) {
  std::atomic<int> done{0};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ProjectionScheduler::Chunk chunk;
    chunk.x = xs[i].data();
    chunk.y = ys[i].data();
    chunk.rows = sizes[i];
    chunk.done = [&](absl::Status s) {
      EXPECT_TRUE(s.ok()) << s;
      if (s.ok()) ++done;
    };
    EXPECT_TRUE(scheduler->Schedule(std::move(chunk)).ok());
    if (i == 0) absl::SleepFor(absl::Milliseconds(50));  // the first runs
  }
  absl::SleepFor(absl::Milliseconds(20));
  backend->release_first.Notify();
  scheduler->Stop();
  return done.load();
}

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
    for (int64_t r = 0; r < sizes[i]; ++r)
      xs[i][r * kProjectionInDim] = 100.0f * i + r;
  }
  EXPECT_EQ(ScheduleBehindFirst(&backend, scheduler.get(), sizes, xs, ys), 4);
  EXPECT_EQ(backend.launches(), (std::vector<int64_t>{3, 21}));
  // The shared launch named each chunk's own buffer, in queue order.
  const auto destinations = backend.destinations();
  ASSERT_EQ(destinations.size(), 2u);
  ASSERT_EQ(destinations[1].size(), 3u);
  for (size_t i = 1; i < sizes.size(); ++i) {
    EXPECT_EQ(destinations[1][i - 1].y, ys[i].data()) << i;
    EXPECT_EQ(destinations[1][i - 1].rows, sizes[i]) << i;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t r = 0; r < sizes[i]; ++r) {
      EXPECT_EQ(ys[i][r * kProjectionOutDim + 5], 100.0f * i + r + 5)
          << i << "," << r;
    }
  }
  // Chunks larger than a launch are refused with a status.
  ProjectionScheduler::Chunk huge;
  huge.rows = 65;
  EXPECT_EQ(scheduler->Schedule(std::move(huge)).code(),
            absl::StatusCode::kInvalidArgument);
}

// on_launch reports each launch once it has run: its rows, how long its
// oldest chunk waited, the backend's run and the copy out.
TEST(ProjectionSchedulerTest, LaunchTimingsSayWhereTheTimeWent) {
  FakeProjectionBackend backend;
  backend.copy_out_seconds = 0.01;  // as the executor reports it
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
  EXPECT_GE(timings[0].run_seconds, 0.07);          // held 20 + 60 ms
  EXPECT_GE(timings[1].queue_delay_seconds, 0.05);  // behind the held launch
  EXPECT_LT(timings[0].queue_delay_seconds, timings[1].queue_delay_seconds);
  EXPECT_LT(timings[1].run_seconds, timings[0].run_seconds);
  EXPECT_GE(timings[1].run_seconds, 0.0);
  // The executor's copy-out, reported apart from its run.
  EXPECT_EQ(timings[0].copy_out_seconds, 0.01);
  EXPECT_EQ(timings[1].copy_out_seconds, 0.01);
}

// A launch is reported before its chunks complete, so that whatever a
// chunk's completion finishes (a projection stream, counted in the server's
// metrics when its reactor is done) is never scraped without its launches.
TEST(ProjectionSchedulerTest, LaunchIsReportedBeforeItsChunksComplete) {
  FakeProjectionBackend backend;
  backend.release_first.Notify();  // nothing held
  absl::Mutex mu;
  int reported = 0;
  std::vector<int> reported_at_done;
  absl::Notification done;
  ProjectionScheduler::Options options;
  options.max_launch_rows = 64;
  options.num_threads = 1;
  options.on_launch = [&](const ProjectionScheduler::LaunchTimings&) {
    absl::MutexLock lock(&mu);
    ++reported;
  };
  auto scheduler = *ProjectionScheduler::Create(options, &backend);
  std::vector<float> x(4 * kProjectionInDim, 1.0f), y(4 * kProjectionOutDim);
  ProjectionScheduler::Chunk chunk;
  chunk.x = x.data();
  chunk.y = y.data();
  chunk.rows = 4;
  chunk.done = [&](absl::Status s) {
    EXPECT_TRUE(s.ok());
    absl::MutexLock lock(&mu);
    reported_at_done.push_back(reported);
    done.Notify();
  };
  ASSERT_TRUE(scheduler->Schedule(std::move(chunk)).ok());
  done.WaitForNotification();
  scheduler->Stop();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(reported_at_done, std::vector<int>{1});
}

// Many small chunks in one launch, each gets its own rows back: no piece
// shifted into a neighbour's buffer, nothing written past a chunk's rows.
TEST(ProjectionSchedulerTest, EveryChunkOfALaunchGetsItsOwnRows) {
  FakeProjectionBackend backend;
  ProjectionScheduler::Options options;
  options.max_launch_rows = 256;
  options.num_threads = 1;
  auto scheduler = *ProjectionScheduler::Create(options, &backend);
  // The first chunk holds the executor while the others queue behind it.
  const std::vector<int64_t> sizes = {1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89};
  constexpr float kGuard = -7.0f;
  std::vector<std::vector<float>> xs, ys;
  for (size_t i = 0; i < sizes.size(); ++i) {
    xs.emplace_back(sizes[i] * kProjectionInDim);
    // One guard row past each chunk's rows.
    ys.emplace_back((sizes[i] + 1) * kProjectionOutDim, kGuard);
    for (int64_t r = 0; r < sizes[i]; ++r)
      xs[i][r * kProjectionInDim] = 1000.0f * i + r;
  }
  EXPECT_EQ(ScheduleBehindFirst(&backend, scheduler.get(), sizes, xs, ys),
            static_cast<int>(sizes.size()));
  const std::vector<int64_t> launches = backend.launches();
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_EQ(launches[1], 231);  // 1 + 2 + ... + 89 - the first chunk
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t r = 0; r < sizes[i]; ++r) {
      for (int64_t o : {int64_t{0}, int64_t{1}, kProjectionOutDim - 1}) {
        ASSERT_EQ(ys[i][r * kProjectionOutDim + o], 1000.0f * i + r + o)
            << "chunk " << i << " row " << r << " column " << o;
      }
    }
    for (int64_t o = 0; o < kProjectionOutDim; ++o) {
      ASSERT_EQ(ys[i][sizes[i] * kProjectionOutDim + o], kGuard)
          << "chunk " << i;
    }
  }
}

}  // namespace
}  // namespace detlogp::server
