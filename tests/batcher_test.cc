#include "server/batching/batcher.h"

#include "proto/status_details.h"

#include <gtest/gtest.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "kernels/bfloat16.h"
#include "tests/fake_backend.h"
#include "tests/manual_clock.h"
#include "tests/truncatable_shm.h"

// Time in these tests is a ManualClock that moves only when the test (or the
// fake backend's modeled compute) moves it, and "a batch is running" is a
// batch held at the fake backend's gate, so no test sleeps or measures real
// time. A few tests keep the real clock: they cover the default and assert
// nothing about durations. The polling tests run on real time because the
// idle spin does.

namespace detlogp::server {
namespace {

using detlogp::testing::FakeBackend;
using detlogp::testing::ManualClock;
using detlogp::testing::TruncatableShm;

constexpr int64_t kH = 4;

// A job whose row r has hidden[0] = r and target r; completion is recorded.
struct TrackedJob {
  std::shared_ptr<LogpJob> job;
  std::shared_ptr<absl::Notification> done =
      std::make_shared<absl::Notification>();
  std::shared_ptr<absl::Status> status = std::make_shared<absl::Status>();
};

std::shared_ptr<const LogpModel> DefaultModel() {
  static const auto* model =
      new std::shared_ptr<const LogpModel>(FakeBackend::MakeModel(kH, 0.0f));
  return *model;
}

TrackedJob MakeJob(int64_t rows, absl::Time deadline = absl::InfiniteFuture(),
                   float temperature = 1.0f,
                   std::shared_ptr<const LogpModel> model = DefaultModel()) {
  TrackedJob tracked;
  std::vector<uint16_t> hidden(rows * kH);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) {
    hidden[r * kH] = kernels::FloatToBf16(static_cast<float>(r));
    targets[r] = static_cast<int32_t>(2 * r);
  }
  tracked.job = std::make_shared<LogpJob>(
      std::move(model), rows, std::move(hidden), std::move(targets),
      temperature, deadline,
      [done = tracked.done, status = tracked.status](absl::Status s, LogpJob&) {
        *status = s;
        done->Notify();
      });
  return tracked;
}

// A job reading its rows where they lie, at `at` (row r: hidden[0] =
// base + r, target 2r), from memory of `location`.
TrackedJob MakeJobAt(char* at, int64_t rows, float base,
                     const HiddenLocation& location) {
  TrackedJob tracked;
  std::vector<uint16_t> hidden(rows * kH);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) {
    hidden[r * kH] = kernels::FloatToBf16(base + static_cast<float>(r));
    targets[r] = static_cast<int32_t>(2 * r);
  }
  std::memcpy(at, hidden.data(), hidden.size() * sizeof(uint16_t));
  tracked.job = std::make_shared<LogpJob>(
      DefaultModel(), rows, at, nullptr, std::move(targets), 1.0f,
      absl::InfiniteFuture(),
      [done = tracked.done, status = tracked.status](absl::Status s, LogpJob&) {
        *status = s;
        done->Notify();
      });
  tracked.job->set_hidden_location(location);
  return tracked;
}

HiddenLocation SystemRegion(
    const std::string& name,
    HiddenLocation::Kind kind = HiddenLocation::Kind::kHost) {
  HiddenLocation location;
  location.kind = kind;
  location.owner_may_truncate = true;
  location.region = name;
  return location;
}

std::unique_ptr<DynamicBatcher> MakeBatcher(FakeBackend* backend,
                                            DynamicBatcher::Options options) {
  auto batcher = DynamicBatcher::Create(options, backend);
  EXPECT_TRUE(batcher.ok()) << batcher.status();
  return *std::move(batcher);
}

// A batcher on `clock`, whose backend also models its compute time on it.
std::unique_ptr<DynamicBatcher> MakeBatcher(FakeBackend* backend,
                                            DynamicBatcher::Options options,
                                            ManualClock* clock) {
  options.clock = clock;
  backend->set_clock(clock);
  return MakeBatcher(backend, options);
}

// Lets held batches go when a test ends early, so that the batcher's
// destructor, which runs every queued batch, cannot hang on the gate.
// Declare it after the batcher.
auto ReleaseOnExit(FakeBackend& backend) {
  return absl::MakeCleanup([&backend] { backend.ReleaseBatches(); });
}

TEST(DynamicBatcherTest, RejectsBadOptions) {
  FakeBackend backend(kH);
  EXPECT_FALSE(DynamicBatcher::Create({0, 100, 10, 1}, &backend).ok());
  EXPECT_FALSE(DynamicBatcher::Create({8, -1, 10, 1}, &backend).ok());
  EXPECT_FALSE(DynamicBatcher::Create({8, 100, 4, 1}, &backend).ok());
  EXPECT_FALSE(DynamicBatcher::Create({8, 100, 10, 0}, &backend).ok());
  EXPECT_FALSE(DynamicBatcher::Create({8, 100, 10, 1}, nullptr).ok());
}

TEST(DynamicBatcherTest, SplitsLargeRequestsAndScattersEveryRow) {
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {8, 100, 1000, 2});
  TrackedJob job = MakeJob(45);
  ASSERT_TRUE(batcher->Schedule(job.job).ok());
  ASSERT_TRUE(job.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(job.status->ok());
  for (int64_t r = 0; r < 45; ++r) {
    EXPECT_EQ(job.job->logprobs()[r], static_cast<float>(r + 2 * r)) << r;
  }
  for (int64_t size : backend.batch_sizes()) EXPECT_LE(size, 8);
  EXPECT_EQ(backend.rows_computed(), 45);
  EXPECT_EQ(backend.bad_staging_batches(), 0);
}

TEST(DynamicBatcherTest, PoolsRowsOfManyRequestsIntoOneBatch) {
  ManualClock clock;  // never advanced: the batch runs because it is full
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {12, 5'000'000, 1000, 1}, &clock);
  std::vector<TrackedJob> jobs;
  for (int i = 0; i < 4; ++i)
    jobs.push_back(MakeJob(3, absl::InfiniteFuture(), 1.0f + i));
  for (auto& job : jobs) ASSERT_TRUE(batcher->Schedule(job.job).ok());
  for (auto& job : jobs) {
    ASSERT_TRUE(job.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_TRUE(job.status->ok());
  }
  EXPECT_EQ(backend.batch_sizes(), std::vector<int64_t>{12});
  EXPECT_EQ(backend.bad_staging_batches(), 0);  // staged 3, 6, 9, 12
  // Each job kept its own temperature through the shared batch.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(jobs[i].job->lse()[2], 1.0f + i);
}

// Four jobs of 5 rows asking for different extras, pooled into batches of
// 8 (so jobs are cut across batches): each batch computes the union (entropy
// if any row asks, the largest top_k), each row gets back only its own.
TEST(DynamicBatcherTest, BatchesComputeTheUnionOfExtrasAndRowsGetTheirOwn) {
  ManualClock clock;  // never advanced: only full batches run before Stop
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {8, 5'000'000, 1000, 1}, &clock);
  const std::vector<LogpExtras> asked = {
      {true, 0}, {false, 3}, {true, 5}, {false, 0}};
  std::vector<TrackedJob> jobs;
  for (const LogpExtras& extras : asked) {
    jobs.push_back(MakeJob(5));
    jobs.back().job->set_extras(extras);
  }
  for (auto& job : jobs) ASSERT_TRUE(batcher->Schedule(job.job).ok());
  batcher->Stop();  // runs the last, partial batch
  for (size_t j = 0; j < jobs.size(); ++j) {
    ASSERT_TRUE(jobs[j].done->HasBeenNotified());
    ASSERT_TRUE(jobs[j].status->ok());
    LogpJob& job = *jobs[j].job;
    const int32_t k = asked[j].top_k;
    ASSERT_EQ(job.entropy().size(), asked[j].entropy ? 5u : 0u) << "job " << j;
    ASSERT_EQ(job.top_ids().size(), 5u * k);
    ASSERT_EQ(job.top_logprobs().size(), 5u * k);
    for (int64_t r = 0; r < 5; ++r) {
      // Fake rows: hidden[0] = r, target 2r.
      if (asked[j].entropy) {
        EXPECT_EQ(job.entropy()[r], r + 0.001f * (2 * r))
            << "job " << j << " row " << r;
      }
      for (int32_t i = 0; i < k; ++i) {
        EXPECT_EQ(job.top_ids()[r * k + i], 2 * r + i)
            << "job " << j << " row " << r;
        EXPECT_EQ(job.top_logprobs()[r * k + i], -static_cast<float>(r) - i);
      }
    }
  }
  // Rows 0-7: jobs 0 and 1 (+ no job 2 yet): entropy, k 3; rows 8-15: jobs
  // 1, 2, 3: entropy, k 5; rows 16-19: job 3 only: nothing extra.
  EXPECT_EQ(backend.batch_sizes(), (std::vector<int64_t>{8, 8, 4}));
  const std::vector<LogpExtras> batches = backend.batch_extras();
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_TRUE(batches[0].entropy);
  EXPECT_EQ(batches[0].top_k, 3);
  EXPECT_TRUE(batches[1].entropy);
  EXPECT_EQ(batches[1].top_k, 5);
  EXPECT_FALSE(batches[2].entropy);
  EXPECT_EQ(batches[2].top_k, 0);
}

TEST(DynamicBatcherTest, FlushesPartialBatchAfterQueueDelay) {
  ManualClock clock;
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {64, 20'000, 1000, 1}, &clock);
  TrackedJob job = MakeJob(2);
  ASSERT_TRUE(batcher->Schedule(job.job).ok());
  ASSERT_TRUE(clock.WaitForWaiters(1));  // the batch thread waits to flush
  clock.Advance(absl::Microseconds(19'999));
  // Not yet: the thread still waits, the rows still queue.
  EXPECT_EQ(clock.waiters(), 1);
  EXPECT_EQ(batcher->stats().rows_queued, 2);
  EXPECT_FALSE(job.done->HasBeenNotified());
  clock.Advance(absl::Microseconds(1));
  ASSERT_TRUE(job.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(backend.batch_sizes(), std::vector<int64_t>{2});
}

// The queue delay, gather and compute of a batch (metrics) and the job's
// batch times are read from the batcher's clock.
TEST(DynamicBatcherTest, BatchTimesComeFromTheClock) {
  ManualClock clock;
  FakeBackend backend(kH);
  backend.set_delay(absl::Milliseconds(3));
  absl::Mutex mu;
  std::vector<DynamicBatcher::BatchRecord> records;
  DynamicBatcher::Options options{4, 10'000, 1000, 1};
  options.on_batch = [&](const DynamicBatcher::BatchRecord& record) {
    absl::MutexLock lock(&mu);
    records.push_back(record);
  };
  auto batcher = MakeBatcher(&backend, options, &clock);
  const absl::Time scheduled = clock.Now();
  TrackedJob job = MakeJob(2);
  ASSERT_TRUE(batcher->Schedule(job.job).ok());
  ASSERT_TRUE(clock.WaitForWaiters(1));
  clock.Advance(absl::Milliseconds(10));  // the queue delay: flush
  ASSERT_TRUE(job.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(job.status->ok()) << *job.status;
  absl::MutexLock lock(&mu);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].rows, 2);
  EXPECT_EQ(records[0].requests, 1);
  EXPECT_EQ(records[0].queue_delay, absl::Milliseconds(10));
  EXPECT_EQ(records[0].gather, absl::ZeroDuration());
  EXPECT_EQ(records[0].compute, absl::Milliseconds(3));
  EXPECT_TRUE(records[0].ok);
  EXPECT_EQ(job.job->first_batch_start(), scheduled + absl::Milliseconds(10));
  EXPECT_EQ(job.job->last_batch_end(), scheduled + absl::Milliseconds(13));
}

TEST(DynamicBatcherTest, FullQueueIsResourceExhausted) {
  ManualClock clock;
  FakeBackend backend(kH);
  backend.set_delay(absl::Milliseconds(300));
  auto batcher = MakeBatcher(&backend, {4, 0, 8, 1}, &clock);
  auto release = ReleaseOnExit(backend);
  backend.HoldBatches();
  TrackedJob running = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(running.job).ok());
  ASSERT_TRUE(backend.WaitForBatchesStarted(1));  // its rows left the queue
  TrackedJob queued = MakeJob(8);
  ASSERT_TRUE(batcher->Schedule(queued.job).ok());
  TrackedJob refused = MakeJob(1);
  const absl::Status status = batcher->Schedule(refused.job);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("max_queue_rows"), std::string::npos);
  const detlogp::v1::ErrorDetails details = detlogp::v1::DetailsOf(status);
  EXPECT_EQ(details.reason, detlogp::v1::kReasonQueueFull);
  EXPECT_EQ(details.metadata.at("limit"), "8");
  EXPECT_EQ(details.metadata.at("queued"), "8");
  EXPECT_EQ(details.metadata.at("requested"), "1");
  // No batch has finished yet, so no drain rate: one queue delay (none
  // here) plus the default 10 ms.
  ASSERT_TRUE(details.retry_delay.has_value());
  EXPECT_EQ(*details.retry_delay, absl::Milliseconds(10));
  EXPECT_FALSE(refused.done->HasBeenNotified());
  EXPECT_EQ(batcher->stats().rows_rejected, 1);
  backend.ReleaseBatches();
  ASSERT_TRUE(queued.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  // Recovered: room again.
  TrackedJob later = MakeJob(1);
  EXPECT_TRUE(batcher->Schedule(later.job).ok());
  ASSERT_TRUE(later.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(DynamicBatcherTest, RetryDelayFollowsTheDrainRate) {
  ManualClock clock;
  FakeBackend backend(kH);
  backend.set_delay(absl::Milliseconds(100));  // 4 rows per 100 ms: 40/s
  auto batcher = MakeBatcher(&backend, {4, 0, 8, 1}, &clock);
  auto release = ReleaseOnExit(backend);
  TrackedJob first = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(first.job).ok());
  ASSERT_TRUE(first.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  backend.HoldBatches();
  TrackedJob running = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(running.job).ok());
  ASSERT_TRUE(backend.WaitForBatchesStarted(2));  // inside its batch
  TrackedJob queued = MakeJob(8);
  ASSERT_TRUE(batcher->Schedule(queued.job).ok());
  // 4 rows over the bound drain at 40 rows/s in exactly 100 ms.
  const detlogp::v1::ErrorDetails details =
      detlogp::v1::DetailsOf(batcher->Schedule(MakeJob(4).job));
  ASSERT_TRUE(details.retry_delay.has_value());
  EXPECT_EQ(*details.retry_delay, absl::Milliseconds(100));
  // 1 row over the bound: 25 ms.
  const detlogp::v1::ErrorDetails one_row =
      detlogp::v1::DetailsOf(batcher->Schedule(MakeJob(1).job));
  ASSERT_TRUE(one_row.retry_delay.has_value());
  EXPECT_EQ(*one_row.retry_delay, absl::Milliseconds(25));
  // Rows the queue can never hold: waiting cannot help, no delay.
  const absl::Status never = batcher->Schedule(MakeJob(9).job);
  EXPECT_EQ(never.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(detlogp::v1::DetailsOf(never).retry_delay.has_value());
  backend.ReleaseBatches();
  ASSERT_TRUE(queued.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
}

// Options of the bound tests: batches of 4 rows, no queue delay, one thread,
// a row bound far away.
DynamicBatcher::Options BoundOptions() {
  DynamicBatcher::Options options{4, 0, 1000, 1};
  options.max_queue_work_micros = 500'000;
  return options;
}

TEST(DynamicBatcherTest, QueueHoldsItsWorkInTimeAtTheDrainRate) {
  ManualClock clock;
  FakeBackend backend(kH);
  backend.set_delay(absl::Milliseconds(100));  // 4 rows per 100 ms: 40/s
  auto batcher = MakeBatcher(&backend, BoundOptions(), &clock);
  auto release = ReleaseOnExit(backend);
  // No full batch yet: the row bound alone.
  EXPECT_EQ(batcher->queue_capacity_rows(), 1000);
  TrackedJob small = MakeJob(1);
  ASSERT_TRUE(batcher->Schedule(small.job).ok());
  ASSERT_TRUE(small.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  // A batch of 1 row of 4 says nothing of the rate under load.
  EXPECT_EQ(batcher->queue_capacity_rows(), 1000);
  TrackedJob first = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(first.job).ok());
  ASSERT_TRUE(first.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  // 500 ms of work at 40 rows/s.
  EXPECT_EQ(batcher->queue_capacity_rows(), 20);
  backend.HoldBatches();
  TrackedJob running = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(running.job).ok());
  ASSERT_TRUE(backend.WaitForBatchesStarted(3));  // its rows left the queue
  TrackedJob queued = MakeJob(20);
  ASSERT_TRUE(batcher->Schedule(queued.job).ok());
  const absl::Status refused = batcher->Schedule(MakeJob(1).job);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("--max_queue_work_ms=500 at 40 rows/s"),
            std::string::npos)
      << refused.message();
  const detlogp::v1::ErrorDetails details = detlogp::v1::DetailsOf(refused);
  EXPECT_EQ(details.reason, detlogp::v1::kReasonQueueFull);
  EXPECT_EQ(details.metadata.at("limit"), "20");
  ASSERT_TRUE(details.retry_delay.has_value());
  EXPECT_EQ(*details.retry_delay, absl::Milliseconds(25));  // 1 row at 40/s
  // A request larger than the bound in time waits for the queue to empty:
  // 20 rows at 40/s.
  const detlogp::v1::ErrorDetails larger =
      detlogp::v1::DetailsOf(batcher->Schedule(MakeJob(30).job));
  ASSERT_TRUE(larger.retry_delay.has_value());
  EXPECT_EQ(*larger.retry_delay, absl::Milliseconds(500));
  backend.ReleaseBatches();
  ASSERT_TRUE(queued.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(DynamicBatcherTest, QueueBoundInTimeNeverBelowTwoFullBatches) {
  ManualClock clock;
  FakeBackend backend(kH);
  backend.set_delay(absl::Seconds(2));  // 2 rows/s: 1 row of work in 500 ms
  auto batcher = MakeBatcher(&backend, BoundOptions(), &clock);
  auto release = ReleaseOnExit(backend);
  TrackedJob first = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(first.job).ok());
  ASSERT_TRUE(first.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(batcher->queue_capacity_rows(), 8);
  // Into an empty queue a request larger than the bound in time is taken:
  // a slow server still serves every request its row bound allows.
  TrackedJob larger = MakeJob(12);
  EXPECT_TRUE(batcher->Schedule(larger.job).ok());
  ASSERT_TRUE(larger.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(larger.status->ok()) << *larger.status;
}

TEST(DynamicBatcherTest, QueueBoundsTheBytesItHoldsNotTheCallersRegions) {
  FakeBackend backend(kH);
  DynamicBatcher::Options options = BoundOptions();
  options.max_queue_bytes = 6 * kH * 2;  // six rows in messages
  auto batcher = MakeBatcher(&backend, options);
  auto release = ReleaseOnExit(backend);
  backend.HoldBatches();
  TrackedJob running = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(running.job).ok());
  ASSERT_TRUE(backend.WaitForBatchesStarted(1));
  TrackedJob queued = MakeJob(6);
  ASSERT_TRUE(batcher->Schedule(queued.job).ok());
  EXPECT_EQ(batcher->stats().bytes_queued, 6 * kH * 2);
  const absl::Status refused = batcher->Schedule(MakeJob(1).job);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("--max_queue_bytes="), std::string::npos)
      << refused.message();
  ASSERT_TRUE(detlogp::v1::DetailsOf(refused).retry_delay.has_value());
  // Rows in a caller's region hold none of the server's memory.
  std::vector<char> region(8 * kH * 2);
  TrackedJob shared = MakeJobAt(region.data(), 8, 0.0f, SystemRegion("caller"));
  EXPECT_TRUE(batcher->Schedule(shared.job).ok());
  // A request larger than the bound alone: waiting cannot help.
  const absl::Status never = batcher->Schedule(MakeJob(7).job);
  EXPECT_EQ(never.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(detlogp::v1::DetailsOf(never).retry_delay.has_value());
  backend.ReleaseBatches();
  ASSERT_TRUE(queued.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(shared.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(batcher->stats().bytes_queued, 0);
}

TEST(DynamicBatcherTest, InternalJobsPassAFullQueue) {
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {4, 0, 8, 1});
  auto release = ReleaseOnExit(backend);
  backend.HoldBatches();
  TrackedJob running = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(running.job).ok());
  ASSERT_TRUE(backend.WaitForBatchesStarted(1));
  TrackedJob queued = MakeJob(8);
  ASSERT_TRUE(batcher->Schedule(queued.job).ok());
  EXPECT_EQ(batcher->Schedule(MakeJob(2).job).code(),
            absl::StatusCode::kResourceExhausted);
  // A warm-up is not refused and runs; the bound still holds for callers.
  TrackedJob warm_up = MakeJob(2);
  ASSERT_TRUE(batcher->ScheduleInternal(warm_up.job).ok());
  EXPECT_EQ(batcher->stats().rows_queued, 10);
  backend.ReleaseBatches();
  ASSERT_TRUE(warm_up.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(warm_up.status->ok()) << *warm_up.status;
  EXPECT_EQ(warm_up.job->logprobs()[1], 1.0f + 2.0f);  // hidden 1, target 2
  EXPECT_EQ(batcher->stats().rows_rejected, 2);
}

TEST(DynamicBatcherTest, ExpiredAndCancelledRowsAreNeverComputed) {
  ManualClock clock;
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {4, 0, 1000, 1}, &clock);
  auto release = ReleaseOnExit(backend);
  backend.HoldBatches();
  TrackedJob blocker = MakeJob(4);
  ASSERT_TRUE(batcher->Schedule(blocker.job).ok());
  ASSERT_TRUE(backend.WaitForBatchesStarted(1));
  const absl::Time deadline = clock.Now() + absl::Milliseconds(10);
  TrackedJob expired = MakeJob(6, deadline);
  TrackedJob cancelled = MakeJob(5);
  // One nanosecond from expiry when the queue is next looked at.
  TrackedJob in_time = MakeJob(3, deadline + absl::Nanoseconds(1));
  ASSERT_TRUE(batcher->Schedule(expired.job).ok());
  ASSERT_TRUE(batcher->Schedule(cancelled.job).ok());
  ASSERT_TRUE(batcher->Schedule(in_time.job).ok());
  cancelled.job->Cancel();
  clock.Advance(absl::Milliseconds(10));  // `expired` reaches its deadline
  backend.ReleaseBatches();
  for (TrackedJob* job : {&blocker, &expired, &cancelled, &in_time}) {
    ASSERT_TRUE(job->done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  }
  EXPECT_EQ(expired.status->code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.status->code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(in_time.status->ok()) << *in_time.status;
  EXPECT_TRUE(blocker.status->ok()) << *blocker.status;
  EXPECT_EQ(backend.rows_computed(), 4 + 3);
  EXPECT_EQ(backend.batch_sizes(), (std::vector<int64_t>{4, 3}));
  const DynamicBatcher::Stats stats = batcher->stats();
  EXPECT_EQ(stats.rows_expired, 6);
  EXPECT_EQ(stats.rows_cancelled, 5);
  EXPECT_EQ(stats.rows_computed, 4 + 3);
}

TEST(DynamicBatcherTest, BackendFailureFailsOnlyThatBatch) {
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {4, 0, 1000, 1});
  backend.set_fail(true);
  TrackedJob failed = MakeJob(3);
  ASSERT_TRUE(batcher->Schedule(failed.job).ok());
  ASSERT_TRUE(failed.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(failed.status->code(), absl::StatusCode::kInternal);
  backend.set_fail(false);
  TrackedJob fine = MakeJob(3);
  ASSERT_TRUE(batcher->Schedule(fine.job).ok());
  ASSERT_TRUE(fine.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(fine.status->ok());
}

TEST(DynamicBatcherTest, StopAnswersEverythingQueuedThenRefuses) {
  ManualClock clock;
  FakeBackend backend(kH);
  backend.set_delay(absl::Milliseconds(20));
  auto batcher = MakeBatcher(&backend, {4, 1'000'000, 1000, 2}, &clock);
  std::vector<TrackedJob> jobs;
  for (int i = 0; i < 10; ++i) {
    jobs.push_back(MakeJob(3));
    ASSERT_TRUE(batcher->Schedule(jobs.back().job).ok());
  }
  batcher->Stop();
  for (auto& job : jobs) {
    EXPECT_TRUE(job.done->HasBeenNotified());
    EXPECT_TRUE(job.status->ok());
  }
  EXPECT_EQ(backend.rows_computed(), 30);
  TrackedJob late = MakeJob(1);
  EXPECT_EQ(batcher->Schedule(late.job).code(), absl::StatusCode::kUnavailable);
}

// With or without a polling batch thread. The first batch is held running
// throughout, so the second can only be the idle thread's.
void ExpectSecondBatchOnlyWhenEnoughRowsWait(int64_t idle_spin_micros) {
  FakeBackend backend(kH);
  DynamicBatcher::Options options{8, 0, 1000, 2};
  options.min_rows_to_overlap = 2;
  options.idle_spin_micros = idle_spin_micros;
  auto batcher = MakeBatcher(&backend, options);
  auto release = ReleaseOnExit(backend);
  backend.HoldBatches();
  TrackedJob first = MakeJob(1);
  ASSERT_TRUE(batcher->Schedule(first.job).ok());
  ASSERT_TRUE(backend.WaitForBatchesStarted(1));
  TrackedJob second = MakeJob(1);
  ASSERT_TRUE(batcher->Schedule(second.job).ok());
  // One row waiting is below the overlap threshold: the idle thread leaves
  // it queued (the batch sizes below show it was not taken alone later).
  EXPECT_EQ(batcher->stats().rows_queued, 1);
  EXPECT_EQ(backend.batches_started(), 1);
  TrackedJob third = MakeJob(1);
  ASSERT_TRUE(batcher->Schedule(third.job).ok());
  // Two rows waiting: overlap, while the first batch still runs.
  ASSERT_TRUE(backend.WaitForBatchesStarted(2));
  EXPECT_EQ(batcher->stats().rows_queued, 0);
  backend.ReleaseBatches();
  for (auto* job : {&first, &second, &third}) {
    ASSERT_TRUE(job->done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  }
  EXPECT_EQ(backend.batch_sizes(), (std::vector<int64_t>{1, 2}));
}

TEST(DynamicBatcherTest, SecondBatchStartsOnlyWhenEnoughRowsWait) {
  ExpectSecondBatchOnlyWhenEnoughRowsWait(0);
}

TEST(DynamicBatcherTest, PollingThreadKeepsTheOverlapGate) {
  ExpectSecondBatchOnlyWhenEnoughRowsWait(1'000'000);
}

// Calls that come while a thread polls and calls that come after it gave up
// and sleeps. Instead of sleeping between calls, the polling window varies:
// 1 µs (the poller has nearly always given up when the next call comes),
// 2 ms, and a minute (it always still polls). Real time, as polling is;
// nothing here asserts a duration.
void ExpectSporadicCallsServed(int64_t idle_spin_micros) {
  FakeBackend backend(kH);
  DynamicBatcher::Options options{8, 0, 1000, 2};
  options.idle_spin_micros = idle_spin_micros;
  auto batcher = MakeBatcher(&backend, options);
  int64_t rows_sent = 0;
  for (int i = 0; i < 40; ++i) {
    const int64_t rows = 1 + i % 11;  // some are cut into two batches
    TrackedJob job = MakeJob(rows);
    ASSERT_TRUE(batcher->Schedule(job.job).ok());
    ASSERT_TRUE(job.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(job.status->ok());
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(job.job->logprobs()[r], static_cast<float>(3 * r));
    }
    rows_sent += rows;
  }
  EXPECT_EQ(backend.rows_computed(), rows_sent);
  EXPECT_EQ(backend.bad_staging_batches(), 0);
}

TEST(DynamicBatcherTest, PollingThreadServesSporadicCalls) {
  for (int64_t idle_spin_micros : {1, 2000, 60'000'000}) {
    SCOPED_TRACE(idle_spin_micros);
    ExpectSporadicCallsServed(idle_spin_micros);
  }
}

TEST(DynamicBatcherTest, StopWakesAPollingThread) {
  FakeBackend backend(kH);
  DynamicBatcher::Options options{8, 0, 1000, 2};
  options.idle_spin_micros = 3'600'000'000;  // would poll an hour
  auto batcher = MakeBatcher(&backend, options);
  TrackedJob job = MakeJob(3);
  ASSERT_TRUE(batcher->Schedule(job.job).ok());
  ASSERT_TRUE(job.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  // A thread polls from start-up and again after each batch. Were Stop not
  // to wake it, Stop would block for an hour and the test time out.
  batcher->Stop();
  EXPECT_EQ(batcher->Schedule(MakeJob(1).job).code(),
            absl::StatusCode::kUnavailable);
}

TEST(DynamicBatcherTest, EmptyJobCompletesAtOnce) {
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {4, 0, 1000, 1});
  TrackedJob empty = MakeJob(0);
  ASSERT_TRUE(batcher->Schedule(empty.job).ok());
  EXPECT_TRUE(empty.done->HasBeenNotified());
  EXPECT_TRUE(empty.status->ok());
}

TEST(DynamicBatcherTest, BatchesHoldRowsOfOneModelAndJobsStayOnTheirModel) {
  FakeBackend backend(kH);
  // Two models of different widths, interleaved; B's jobs are cut into slices.
  const auto model_a = FakeBackend::MakeModel(kH, 0.0f);
  const auto model_b = FakeBackend::MakeModel(2 * kH, 1000.0f);
  // The first batches are held while every job queues, so rows of both
  // models wait together; then Stop runs the rest.
  ManualClock clock;
  backend.set_delay(absl::Milliseconds(2));
  auto batcher = MakeBatcher(&backend, {8, 1000, 1000, 2}, &clock);
  auto release = ReleaseOnExit(backend);
  backend.HoldBatches();
  std::vector<std::pair<TrackedJob, float>> jobs;
  for (int i = 0; i < 12; ++i) {
    const bool b = i % 2 == 1;
    const int64_t rows = b ? 19 : 3;
    std::vector<uint16_t> hidden(rows * (b ? 2 * kH : kH));
    std::vector<int32_t> targets(rows);
    for (int64_t r = 0; r < rows; ++r) {
      hidden[r * (b ? 2 * kH : kH)] =
          kernels::FloatToBf16(static_cast<float>(r));
      targets[r] = static_cast<int32_t>(r);
    }
    TrackedJob tracked;
    tracked.job = std::make_shared<LogpJob>(
        b ? model_b : model_a, rows, std::move(hidden), std::move(targets),
        1.0f, absl::InfiniteFuture(),
        [done = tracked.done, status = tracked.status](absl::Status s,
                                                       LogpJob&) {
          *status = s;
          done->Notify();
        });
    ASSERT_TRUE(batcher->Schedule(tracked.job).ok());
    jobs.emplace_back(std::move(tracked), b ? 1000.0f : 0.0f);
  }
  EXPECT_EQ(batcher->stats().rows_computed, 0);
  backend.ReleaseBatches();
  batcher->Stop();
  for (auto& [tracked, offset] : jobs) {
    ASSERT_TRUE(tracked.done->HasBeenNotified());
    ASSERT_TRUE(tracked.status->ok()) << *tracked.status;
    for (int64_t r = 0; r < tracked.job->rows(); ++r) {
      // Every slice of the job ran on the job's model.
      EXPECT_EQ(tracked.job->logprobs()[r], 2.0f * r + offset) << "row " << r;
    }
  }
  // Rows of both models waited together, yet no batch mixed them: each batch
  // is one model's (the fake runs a whole batch on one model), and the rows
  // of every batch add up.
  const std::vector<float> models = backend.batch_models();
  EXPECT_NE(std::count(models.begin(), models.end(), 0.0f), 0);
  EXPECT_NE(std::count(models.begin(), models.end(), 1000.0f), 0);
  EXPECT_EQ(backend.rows_computed(), 6 * 3 + 6 * 19);
}

// A region whose owner truncated it under the gather fails its own request
// only: the other rows of the batch are staged in order, computed and
// scattered back to their own jobs.
TEST(DynamicBatcherTest, ARegionTruncatedUnderTheGatherFailsOnlyItsRequest) {
  auto shm = TruncatableShm::Create(2);
  ASSERT_NE(shm, nullptr);
  ManualClock clock;  // never advanced: the batch runs because it is full
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {12, 5'000'000, 1000, 1}, &clock);
  TrackedJob before = MakeJob(3);
  // Pinned, but the fake executor does not copy rows itself: the batcher
  // reads them, through the guard.
  TrackedJob shrunk =
      MakeJobAt(shm->page(1), 3, 100.0f,
                SystemRegion("shrunk", HiddenLocation::Kind::kPinnedHost));
  TrackedJob intact =
      MakeJobAt(shm->page(0), 3, 200.0f, SystemRegion("intact"));
  TrackedJob after = MakeJob(3);
  ASSERT_TRUE(shm->TruncateToPages(1));
  for (TrackedJob* job : {&before, &shrunk, &intact, &after}) {
    ASSERT_TRUE(batcher->Schedule(job->job).ok());
  }
  for (TrackedJob* job : {&before, &shrunk, &intact, &after}) {
    ASSERT_TRUE(job->done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  }
  EXPECT_EQ(shrunk.status->code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(shrunk.status->message(),
                               "hidden.shared_memory: region \"shrunk\""))
      << *shrunk.status;
  for (const auto& [job, base] : std::vector<std::pair<TrackedJob*, float>>{
           {&before, 0.0f}, {&intact, 200.0f}, {&after, 0.0f}}) {
    ASSERT_TRUE(job->status->ok()) << *job->status;
    for (int64_t r = 0; r < 3; ++r) {
      EXPECT_EQ(job->job->logprobs()[r], base + static_cast<float>(3 * r))
          << "base " << base << " row " << r;
    }
  }
  EXPECT_EQ(backend.batch_sizes(), std::vector<int64_t>{9});
  EXPECT_EQ(backend.bad_staging_batches(), 0);
  const DynamicBatcher::Stats stats = batcher->stats();
  EXPECT_EQ(stats.rows_failed, 3);
  EXPECT_EQ(stats.rows_computed, 9);
}

TEST(DynamicBatcherTest, ABatchOfOnlyTruncatedRowsEndsAndTheNextRuns) {
  auto shm = TruncatableShm::Create(2);
  ASSERT_NE(shm, nullptr);
  FakeBackend backend(kH);
  auto batcher = MakeBatcher(&backend, {4, 0, 1000, 1});
  TrackedJob shrunk =
      MakeJobAt(shm->page(1), 3, 100.0f, SystemRegion("shrunk"));
  ASSERT_TRUE(shm->TruncateToPages(0));
  ASSERT_TRUE(batcher->Schedule(shrunk.job).ok());
  ASSERT_TRUE(shrunk.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(shrunk.status->code(), absl::StatusCode::kFailedPrecondition);
  TrackedJob fine = MakeJob(3);
  ASSERT_TRUE(batcher->Schedule(fine.job).ok());
  ASSERT_TRUE(fine.done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(fine.status->ok()) << *fine.status;
  EXPECT_EQ(fine.job->logprobs()[2], 6.0f);
  EXPECT_EQ(backend.batch_sizes(), std::vector<int64_t>{3});
}

}  // namespace
}  // namespace detlogp::server
