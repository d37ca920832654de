// DynamicBatcher pools rows from every in-flight request into batches for a
// LogpBackend.
//
// Parameters (Options): a batch holds at most `max_batch_rows` rows; the
// first row queued waits at most `max_queue_delay_micros` for company before
// its batch runs anyway; the queue holds at most `max_queue_work_micros` of
// work at the rate full batches drain it (measured), never more than
// `max_queue_rows` rows nor `max_queue_bytes` of rows held in the server's
// memory (more is RESOURCE_EXHAUSTED with reason QUEUE_FULL and a retry
// delay estimated from the queue and its drain rate); up to
// `num_batch_threads`
// batches run at once, each on its own executor (a second one only once
// `min_rows_to_overlap` rows wait).
//
// Flow: Schedule() runs on the caller's thread: it checks the bound and
// queues the job (FIFO per model: a batch holds rows of one model version
// only). A batch thread picks the model whose oldest job waited longest,
// takes rows from the front of its queue (cutting a job into slices when it
// does not fit), drops jobs that were cancelled or whose deadline passed
// (their rows are never computed), gathers the rows into its executor's
// staging, runs it, scatters the outputs back into each job and completes
// the jobs whose last row it carried. A batch computes entropy when any of
// its rows asks for it and the largest top_k any row asks for (LogpExtras);
// each row gets back only what it asked for. Every slice of a job runs on the
// job's model.
//
// The batcher reads the time and waits until a time through Options::clock
// (queue delays, deadlines, BatchRecord's timings, the drain rate): the wall
// clock unless a test passes a manual one.
//
// Batching is free because backends are batch invariant: which rows share a
// batch changes timing, never bits.
//
// Example:
//   auto batcher = DynamicBatcher::Create(options, backend);
//   absl::Status s = (*batcher)->Schedule(job);  // job completes later
//   ...
//   (*batcher)->Stop();  // runs everything queued, then joins
#ifndef DETLOGP_SERVER_BATCHING_BATCHER_H_
#define DETLOGP_SERVER_BATCHING_BATCHER_H_

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backends/backend.h"
#include "server/batching/clock.h"
#include "server/batching/logp_job.h"

namespace detlogp::server {

class DynamicBatcher {
 public:
  // What one batch did, for metrics.
  struct BatchRecord {
    int64_t rows = 0;
    int64_t requests = 0;        // request slices in the batch
    absl::Duration queue_delay;  // how long its oldest slice waited
    absl::Duration gather;       // copying its rows into the staging
    absl::Duration compute;      // the backend's Run, copies included
    bool ok = true;
  };

  struct Options {
    int64_t max_batch_rows = 256;
    int64_t max_queue_delay_micros = 500;
    // Rows waiting at most; also the bound while no full batch has run yet
    // (the drain rate is unknown).
    int64_t max_queue_rows = 1 << 20;
    int num_batch_threads = 1;
    // While a batch runs, another starts only once this many rows wait (-1:
    // max_batch_rows / 4). Under light load this keeps one batch in flight,
    // so small calls do not queue behind each other on the device; under
    // heavy load every thread works.
    int64_t min_rows_to_overlap = -1;
    // An idle batch thread polls for work this long before it sleeps (one
    // thread at a time). Waking a sleeping thread costs tens of
    // microseconds, a real share of a sub-millisecond GPU batch; 0 never
    // polls (right for CPU backends, whose batch threads share the cores).
    int64_t idle_spin_micros = 0;
    // The queue's bound in time: rows waiting at most, as work at the rate
    // full batches drain them. A fast model (a GPU at H=4096) queues a
    // whole fleet's burst, a slow one (a CPU) no more than this much
    // latency. Never below two full batches per batch thread, and never
    // refusing a request into an empty queue. 0: rows only.
    int64_t max_queue_work_micros = 1'000'000;
    // bf16 bytes of waiting rows held in the server's memory (rows that
    // came in the messages; rows in shared memory are the caller's).
    int64_t max_queue_bytes = int64_t{2} << 30;
    // Called after every batch on its batch thread; may be empty.
    std::function<void(const BatchRecord&)> on_batch;
    // The time the batcher reads and waits on; not owned, must outlive the
    // batcher. Null: Clock::Real(). Tests pass a manual clock.
    Clock* clock = nullptr;
  };

  // Counters since start; all rows, not requests.
  struct Stats {
    int64_t batches_run = 0;
    int64_t rows_computed = 0;
    int64_t rows_failed = 0;     // computed in a batch the backend failed
    int64_t rows_expired = 0;    // dropped before compute: deadline passed
    int64_t rows_cancelled = 0;  // dropped before compute: call cancelled
    int64_t rows_rejected = 0;   // refused by Schedule: queue full
    int64_t rows_queued = 0;     // waiting now
    int64_t bytes_queued = 0;    // of those, bf16 bytes in server memory
  };

  // Validates options and creates one executor per batch thread.
  static absl::StatusOr<std::unique_ptr<DynamicBatcher>> Create(
      const Options& options, LogpBackend* backend);

  ~DynamicBatcher();
  DynamicBatcher(const DynamicBatcher&) = delete;
  DynamicBatcher& operator=(const DynamicBatcher&) = delete;

  // Queues `job`. Returns RESOURCE_EXHAUSTED when the queue is full and
  // UNAVAILABLE after Stop(); the job is not completed then, the caller owns
  // the answer.
  absl::Status Schedule(std::shared_ptr<LogpJob> job);
  // Schedule for the server's own few rows (a new version's warm-up): never
  // refused for a full queue, so scoring traffic cannot fail a load whose
  // weights already arrived. UNAVAILABLE after Stop().
  absl::Status ScheduleInternal(std::shared_ptr<LogpJob> job);

  // Stops accepting, runs everything already queued, joins the threads.
  void Stop();

  Stats stats() const;
  const Options& options() const { return options_; }
  // The rows the queue holds at most now (ModelInfo.max_queue_rows): the
  // row bound, lowered to max_queue_work_micros of work once the rate of
  // full batches is known.
  int64_t queue_capacity_rows() const;

  // ---- Implementation details; API users need not read further. ----
 private:
  struct Slice {
    std::shared_ptr<LogpJob> job;
    int64_t row_begin;
    int64_t row_count;
    absl::Time queued;  // when its job was accepted
  };
  struct QueuedJob {
    std::shared_ptr<LogpJob> job;
    int64_t next_row;   // first row not yet taken into a batch
    absl::Time queued;  // when Schedule accepted it
  };
  // The jobs of one model, FIFO.
  struct ModelQueue {
    const LogpModel* model;
    std::deque<QueuedJob> jobs;
  };

  absl::Status Enqueue(std::shared_ptr<LogpJob> job, bool bounded);
  int64_t CapacityRowsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // bf16 bytes of `rows` rows of `job` held in the server's memory while
  // they wait (0 for rows in shared memory).
  static int64_t HeldBytes(const LogpJob& job, int64_t rows);
  // Rows of `job` leave the queue (taken into a batch or dropped).
  void DequeueRowsLocked(const LogpJob& job, int64_t rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED with reason QUEUE_FULL and, when waiting can help,
  // a retry delay: how long the queue takes to drain room for `rows`.
  // `excess_rows`: rows over the bound that binds; `never`: the request
  // alone passes it.
  absl::Status QueueFullErrorLocked(int64_t rows, int64_t capacity,
                                    int64_t excess_rows, bool never,
                                    absl::string_view bound) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration RetryDelayLocked(int64_t excess_rows) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Folds a finished batch into the drain rate (rows per second); only
  // batches of at least half max_batch_rows count: a small batch's rate
  // says little about what the queue drains under load.
  void NoteDrainRateLocked(int64_t rows, absl::Duration busy,
                           int batches_running)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr absl::Duration kDefaultRetryDelay = absl::Milliseconds(10);
  static constexpr absl::Duration kMinRetryDelay = absl::Milliseconds(1);
  static constexpr absl::Duration kMaxRetryDelay = absl::Seconds(2);

  DynamicBatcher(const Options& options,
                 std::vector<std::unique_ptr<LogpExecutor>> executors);

  void BatchLoop(LogpExecutor* executor);
  // Waits for work and takes up to max_batch_rows rows; empty when stopping
  // with nothing left.
  std::vector<Slice> NextBatch();
  // Drops dead jobs at the queue's front; completes them outside the lock.
  void DropDeadJobsLocked(absl::Time now,
                          std::vector<std::pair<Slice, absl::Status>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveEmptyQueuesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunBatch(LogpExecutor* executor, std::vector<Slice>& batch);
  // Copies a slice's entropy and first top_k entries of each row's top list
  // (the batch computed `batch_top_k`) from the staging at row `offset`.
  static void ScatterExtras(const LogpStaging& staging, int32_t batch_top_k,
                            int64_t offset, const Slice& slice);
  // Fails every slice of a batch that could not start.
  void FailBatch(std::vector<Slice>& batch, const absl::Status& status);
  bool HasFullBatchOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The queue whose front job waited longest; queues_ must not be empty.
  ModelQueue& OldestQueueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CanStartBatchOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ShouldWakeSleepingThread() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls, releasing mu_ while it does, until a batch can start or
  // idle_spin_micros pass; returns at once when another thread polls.
  void SpinUntilBatchCanStartLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells a polling thread that the queue or the batches in flight changed.
  void NotifyStateChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    state_version_.fetch_add(1, std::memory_order_release);
  }

  const Options options_;
  Clock* const clock_;  // options_.clock or the real clock
  std::vector<std::unique_ptr<LogpExecutor>> executors_;
  std::vector<std::thread> threads_;

  mutable absl::Mutex mu_;
  // Non-empty queues only; a handful (one per model version in use).
  std::vector<ModelQueue> queues_ ABSL_GUARDED_BY(mu_);
  int64_t queued_rows_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // HeldBytes of them
  int batches_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool thread_polling_ ABSL_GUARDED_BY(mu_) = false;
  // Rows per second the batch threads drain (a moving average of full
  // batches; 0 before the first), for the queue's bound in time and the
  // retry delay of a refused call.
  double drain_rows_per_second_ ABSL_GUARDED_BY(mu_) = 0;
  // Bumped under mu_ on every change a polling thread waits for; read
  // without it.
  std::atomic<uint64_t> state_version_{0};

  std::atomic<int64_t> batches_run_{0};
  std::atomic<int64_t> rows_computed_{0};
  std::atomic<int64_t> rows_failed_{0};
  std::atomic<int64_t> rows_expired_{0};
  std::atomic<int64_t> rows_cancelled_{0};
  std::atomic<int64_t> rows_rejected_{0};
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BATCHING_BATCHER_H_
