#include "server/batcher.h"

#include <algorithm>
#include <cstring>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"

namespace detlogp::server {

absl::StatusOr<std::unique_ptr<DynamicBatcher>> DynamicBatcher::Create(
    const Options& options, LogpBackend* backend) {
  if (options.max_batch_rows <= 0) {
    return absl::InvalidArgumentError("max_batch_rows must be positive");
  }
  if (options.hold_after_batch_micros < 0) {
    return absl::InvalidArgumentError("hold_after_batch_micros must be >= 0");
  }
  if (options.max_queue_delay_micros < 0) {
    return absl::InvalidArgumentError("max_queue_delay_micros must be >= 0");
  }
  if (options.max_queue_rows < options.max_batch_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queue_rows (", options.max_queue_rows,
        ") must be at least max_batch_rows (", options.max_batch_rows, ")"));
  }
  if (options.num_batch_threads <= 0) {
    return absl::InvalidArgumentError("num_batch_threads must be positive");
  }
  if (backend == nullptr) return absl::InvalidArgumentError("no backend");
  std::vector<std::unique_ptr<LogpExecutor>> executors;
  for (int i = 0; i < options.num_batch_threads; ++i) {
    auto executor = backend->NewExecutor(options.max_batch_rows);
    if (!executor.ok()) return executor.status();
    executors.push_back(*std::move(executor));
  }
  return absl::WrapUnique(new DynamicBatcher(options, std::move(executors)));
}

DynamicBatcher::DynamicBatcher(
    const Options& options,
    std::vector<std::unique_ptr<LogpExecutor>> executors)
    : options_(options), executors_(std::move(executors)) {
  for (auto& executor : executors_) {
    threads_.emplace_back([this, e = executor.get()] { BatchLoop(e); });
  }
}

DynamicBatcher::~DynamicBatcher() { Stop(); }

absl::Status DynamicBatcher::Schedule(std::shared_ptr<LogpJob> job) {
  const int64_t rows = job->rows();
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      return absl::UnavailableError("server is shutting down");
    }
    if (queued_rows_ + staged_rows_ + rows > options_.max_queue_rows) {
      rows_rejected_.fetch_add(rows, std::memory_order_relaxed);
      return absl::ResourceExhaustedError(absl::StrCat(
          "queue full: ", queued_rows_, " rows waiting + ", rows,
          " requested > --max_queue_rows=", options_.max_queue_rows,
          "; retry with backoff"));
    }
    if (rows > 0) {
      queue_.push_back(QueuedJob{job, 0, absl::Now()});
      queued_rows_ += rows;
      NotifyStateChangedLocked();
      return absl::OkStatus();
    }
  }
  job->FinishRows(0, absl::OkStatus());  // nothing to compute
  return absl::OkStatus();
}

void DynamicBatcher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
    NotifyStateChangedLocked();
  }
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
}

DynamicBatcher::Stats DynamicBatcher::stats() const {
  Stats stats;
  stats.batches_run = batches_run_.load();
  stats.rows_computed = rows_computed_.load();
  stats.rows_failed = rows_failed_.load();
  stats.rows_expired = rows_expired_.load();
  stats.rows_cancelled = rows_cancelled_.load();
  stats.rows_rejected = rows_rejected_.load();
  absl::MutexLock lock(&mu_);
  stats.rows_queued = queued_rows_ + staged_rows_;
  return stats;
}

namespace {

// Tells the core that this is a spin-wait loop (eases the sibling
// hyper-thread and the memory order machinery).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

int64_t DynamicBatcher::OverlapRows() const {
  return options_.min_rows_to_overlap >= 0 ? options_.min_rows_to_overlap
                                           : options_.max_batch_rows / 4;
}

bool DynamicBatcher::CanStartBatchOrStopping() const {
  if (stopping_) return true;
  if (queue_.empty()) return false;
  return batches_in_flight_ == 0 || queued_rows_ >= OverlapRows();
}

bool DynamicBatcher::OwnerCanStartBatchOrStopping() const {
  if (stopping_) return true;
  if (queue_.empty() && staged_rows_ == 0) return false;
  return batches_in_flight_ == 0 ||
         queued_rows_ + staged_rows_ >= OverlapRows();
}

bool DynamicBatcher::ShouldWakeSleepingThread() const {
  if (stopping_) return true;
  // The owner of the next batch takes the work; waking a sleeper as well
  // would only cost the waker a system call.
  if (next_batch_owner_) return false;
  // While the device is busy, a polling thread should gather what arrives.
  const bool want_owner =
      options_.idle_spin_micros > 0 && batches_in_flight_ > 0;
  return want_owner || CanStartBatchOrStopping();
}

bool DynamicBatcher::HasFullBatchOrStopping() const {
  return stopping_ || queued_rows_ + staged_rows_ >= options_.max_batch_rows;
}

bool DynamicBatcher::PollAsOwnerLocked(
    LogpExecutor* executor, Batch& batch,
    DroppedSlices* dropped) {
  absl::Time give_up = absl::Now() + absl::Microseconds(options_.idle_spin_micros);
  while (!OwnerCanStartBatchOrStopping()) {
    const absl::Time now = absl::Now();
    if (!queue_.empty() && batch.rows < options_.max_batch_rows) {
      // The device is busy: gather what waits now, so that the batch can
      // start the moment the device frees.
      DropDeadJobsLocked(now, dropped);
      staged_rows_ += TakeRowsLocked(batch);
      mu_.Unlock();
      FinishDropped(dropped);
      GatherRows(executor, batch);
      mu_.Lock();
      continue;
    }
    // Give up only once the device has been idle, with nothing to gather,
    // for idle_spin_micros.
    if (batches_in_flight_ > 0) {
      give_up = now + absl::Microseconds(options_.idle_spin_micros);
    } else if (batch.rows == 0 && now >= give_up) {
      next_batch_owner_ = false;
      return false;
    }
    const uint64_t seen = state_version_.load(std::memory_order_acquire);
    mu_.Unlock();
    while (state_version_.load(std::memory_order_acquire) == seen &&
           absl::Now() < give_up) {
      CpuRelax();
    }
    mu_.Lock();
  }
  return true;
}

void DynamicBatcher::DropDeadJobsLocked(
    absl::Time now, DroppedSlices* dropped) {
  for (auto it = queue_.begin(); it != queue_.end();) {
    LogpJob& job = *it->job;
    // A passed deadline wins: gRPC also cancels calls whose deadline passed.
    const bool expired = job.deadline() <= now;
    const bool cancelled = !expired && job.cancelled();
    if (!expired && !cancelled) {
      ++it;
      continue;
    }
    const int64_t remaining = job.rows() - it->next_row;
    (cancelled ? rows_cancelled_ : rows_expired_)
        .fetch_add(remaining, std::memory_order_relaxed);
    dropped->emplace_back(
        Slice{it->job, it->next_row, remaining, it->queued},
        cancelled ? absl::CancelledError("call cancelled before compute")
                  : absl::DeadlineExceededError(
                        "deadline passed while queued; rows not computed"));
    queued_rows_ -= remaining;
    it = queue_.erase(it);
  }
}

int64_t DynamicBatcher::TakeRowsLocked(Batch& batch) {
  int64_t taken = 0;
  while (batch.rows < options_.max_batch_rows && !queue_.empty()) {
    QueuedJob& front = queue_.front();
    const int64_t take = std::min(options_.max_batch_rows - batch.rows,
                                  front.job->rows() - front.next_row);
    batch.slices.push_back(Slice{front.job, front.next_row, take, front.queued});
    batch.rows += take;
    front.next_row += take;
    queued_rows_ -= take;
    taken += take;
    if (front.next_row == front.job->rows()) queue_.pop_front();
  }
  return taken;
}

bool DynamicBatcher::NextBatch(LogpExecutor* executor, Batch& batch) {
  DroppedSlices dropped;
  bool started = false;
  mu_.Lock();
  while (!started) {
    bool owner = false;
    if (options_.idle_spin_micros > 0 && !next_batch_owner_) {
      next_batch_owner_ = true;
      owner = PollAsOwnerLocked(executor, batch, &dropped);
    }
    if (!owner) {
      mu_.Await(absl::Condition(this, &DynamicBatcher::ShouldWakeSleepingThread));
      if (!CanStartBatchOrStopping()) continue;  // woken to poll as owner
    }
    if (stopping_ && queue_.empty() && batch.rows == 0) {
      if (owner) next_batch_owner_ = false;
      break;  // nothing left
    }
    const absl::Time oldest =
        batch.slices.empty() ? queue_.front().queued : batch.slices.front().queued;
    const absl::Time flush_at = std::max(
        oldest + absl::Microseconds(options_.max_queue_delay_micros),
        last_batch_done_ + absl::Microseconds(options_.hold_after_batch_micros));
    // Await releases the lock even when it need not wait; skip it then.
    if (!HasFullBatchOrStopping() && absl::Now() < flush_at) {
      mu_.AwaitWithDeadline(
          absl::Condition(this, &DynamicBatcher::HasFullBatchOrStopping),
          flush_at);
    }
    DropDeadJobsLocked(absl::Now(), &dropped);
    TakeRowsLocked(batch);
    if (owner) {
      next_batch_owner_ = false;
      staged_rows_ = 0;
    }
    if (batch.rows > 0) {
      ++batches_in_flight_;
      started = true;
    } else if (!dropped.empty()) {
      mu_.Unlock();  // complete them without holding the lock
      FinishDropped(&dropped);
      mu_.Lock();
    }
  }
  mu_.Unlock();
  FinishDropped(&dropped);
  return started;
}

void DynamicBatcher::FinishDropped(
    DroppedSlices* dropped) {
  for (auto& [slice, status] : *dropped) {
    slice.job->FinishRows(slice.row_count, status);
  }
  dropped->clear();
}

void DynamicBatcher::BatchLoop(LogpExecutor* executor) {
  Batch batch;
  while (NextBatch(executor, batch)) {
    RunBatch(executor, batch);
    batch = Batch{};
  }
}

void DynamicBatcher::GatherRows(LogpExecutor* executor, Batch& batch) {
  const LogpStaging staging = executor->staging();
  for (; batch.slices_gathered < batch.slices.size(); ++batch.slices_gathered) {
    const Slice& slice = batch.slices[batch.slices_gathered];
    const LogpJob& job = *slice.job;
    const int64_t row_bytes = job.hidden_size() * sizeof(uint16_t);
    const int64_t at = batch.rows_gathered;
    std::memcpy(reinterpret_cast<char*>(staging.hidden) + at * row_bytes,
                job.hidden_bf16() + slice.row_begin * row_bytes,
                slice.row_count * row_bytes);
    std::memcpy(staging.targets + at, job.targets().data() + slice.row_begin,
                slice.row_count * sizeof(int32_t));
    std::fill_n(staging.temperatures + at, slice.row_count, job.temperature());
    batch.rows_gathered += slice.row_count;
    executor->RowsStaged(batch.rows_gathered);
  }
}

void DynamicBatcher::RunBatch(LogpExecutor* executor, Batch& batch) {
  const absl::Time gather_start = absl::Now();
  GatherRows(executor, batch);
  const LogpStaging staging = executor->staging();
  const int64_t rows = batch.rows;
  const absl::Time start = absl::Now();
  const absl::Status status = executor->Run(rows);
  const absl::Time end = absl::Now();
  {
    // The device is free for the next batch while this one's outputs are
    // scattered and its calls answered.
    absl::MutexLock lock(&mu_);
    --batches_in_flight_;
    last_batch_done_ = end;
    NotifyStateChangedLocked();
  }
  if (options_.on_batch) {
    BatchRecord record;
    record.rows = rows;
    record.requests = static_cast<int64_t>(batch.slices.size());
    record.queue_delay = gather_start - batch.slices.front().queued;
    record.gather = start - gather_start;
    record.compute = end - start;
    record.ok = status.ok();
    options_.on_batch(record);
  }
  batches_run_.fetch_add(1, std::memory_order_relaxed);
  (status.ok() ? rows_computed_ : rows_failed_)
      .fetch_add(rows, std::memory_order_relaxed);
  int64_t offset = 0;
  for (Slice& slice : batch.slices) {
    if (status.ok()) {
      std::copy_n(staging.logprobs + offset, slice.row_count,
                  slice.job->logprobs().begin() + slice.row_begin);
      std::copy_n(staging.lse + offset, slice.row_count,
                  slice.job->lse().begin() + slice.row_begin);
    }
    offset += slice.row_count;
    slice.job->FinishRows(slice.row_count, status);
  }
}

}  // namespace detlogp::server
