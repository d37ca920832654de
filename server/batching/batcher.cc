#include "server/batching/batcher.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "proto/status_details.h"
#include "server/shared_memory/mapped_reads.h"

namespace detlogp::server {

absl::StatusOr<std::unique_ptr<DynamicBatcher>> DynamicBatcher::Create(
    const Options& options, LogpBackend* backend) {
  if (options.max_batch_rows <= 0) {
    return absl::InvalidArgumentError("max_batch_rows must be positive");
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
  if (options.max_queue_work_micros < 0) {
    return absl::InvalidArgumentError("max_queue_work_micros must be >= 0");
  }
  if (options.max_queue_bytes <= 0) {
    return absl::InvalidArgumentError("max_queue_bytes must be positive");
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
    : options_(options),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      executors_(std::move(executors)) {
  for (auto& executor : executors_) {
    threads_.emplace_back([this, e = executor.get()] { BatchLoop(e); });
  }
}

DynamicBatcher::~DynamicBatcher() { Stop(); }

absl::Status DynamicBatcher::Schedule(std::shared_ptr<LogpJob> job) {
  return Enqueue(std::move(job), /*bounded=*/true);
}

absl::Status DynamicBatcher::ScheduleInternal(std::shared_ptr<LogpJob> job) {
  return Enqueue(std::move(job), /*bounded=*/false);
}

absl::Status DynamicBatcher::Enqueue(std::shared_ptr<LogpJob> job,
                                     bool bounded) {
  const int64_t rows = job->rows();
  const int64_t bytes = HeldBytes(*job, rows);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      return absl::UnavailableError("server is shutting down");
    }
    // A request of no rows holds no room (and needs none).
    if (bounded && rows > 0) {
      const int64_t capacity = CapacityRowsLocked();
      const bool by_time = capacity < options_.max_queue_rows;
      // The bound in time never refuses a request into an empty queue: a
      // request the row and byte bounds take is served, however slow.
      const bool alone_by_time =
          by_time && queued_rows_ == 0 && rows <= options_.max_queue_rows;
      if (queued_rows_ + rows > capacity && !alone_by_time) {
        rows_rejected_.fetch_add(rows, std::memory_order_relaxed);
        // Waiting for the queue to empty always suffices.
        return QueueFullErrorLocked(
            rows, capacity,
            std::min(queued_rows_ + rows - capacity, queued_rows_),
            rows > options_.max_queue_rows,
            by_time
                ? absl::StrCat("--max_queue_work_ms=",
                               options_.max_queue_work_micros / 1000, " at ",
                               static_cast<int64_t>(drain_rows_per_second_),
                               " rows/s")
                : absl::StrCat("--max_queue_rows=", options_.max_queue_rows));
      }
      if (bytes > 0 && queued_bytes_ + bytes > options_.max_queue_bytes) {
        rows_rejected_.fetch_add(rows, std::memory_order_relaxed);
        const int64_t row_bytes = std::max<int64_t>(bytes / rows, 1);
        return QueueFullErrorLocked(
            rows, capacity,
            (queued_bytes_ + bytes - options_.max_queue_bytes + row_bytes - 1) /
                row_bytes,
            bytes > options_.max_queue_bytes,
            absl::StrCat("--max_queue_bytes=", options_.max_queue_bytes));
      }
    }
    if (rows > 0) {
      auto it = std::find_if(
          queues_.begin(), queues_.end(),
          [&](const ModelQueue& q) { return q.model == job->model().get(); });
      if (it == queues_.end()) {
        it = queues_.insert(queues_.end(), ModelQueue{job->model().get(), {}});
      }
      it->jobs.push_back(QueuedJob{job, 0, clock_->Now()});
      queued_rows_ += rows;
      queued_bytes_ += bytes;
      NotifyStateChangedLocked();
      return absl::OkStatus();
    }
  }
  job->FinishRows(0, absl::OkStatus());  // nothing to compute
  return absl::OkStatus();
}

int64_t DynamicBatcher::queue_capacity_rows() const {
  absl::MutexLock lock(&mu_);
  return CapacityRowsLocked();
}

int64_t DynamicBatcher::CapacityRowsLocked() const {
  if (options_.max_queue_work_micros <= 0 || drain_rows_per_second_ <= 0) {
    return options_.max_queue_rows;
  }
  const double work_rows = drain_rows_per_second_ *
                           static_cast<double>(options_.max_queue_work_micros) *
                           1e-6;
  const int64_t floor =
      2 * options_.max_batch_rows * int64_t{options_.num_batch_threads};
  const int64_t by_time =
      std::max(floor, static_cast<int64_t>(std::min(work_rows, 9.0e18)));
  return std::min(options_.max_queue_rows, by_time);
}

int64_t DynamicBatcher::HeldBytes(const LogpJob& job, int64_t rows) {
  const HiddenLocation& location = job.hidden_location();
  const bool in_shared_memory =
      location.kind != HiddenLocation::Kind::kHost || !location.region.empty();
  return in_shared_memory ? 0 : rows * job.hidden_size() * 2;
}

void DynamicBatcher::DequeueRowsLocked(const LogpJob& job, int64_t rows) {
  queued_rows_ -= rows;
  queued_bytes_ -= HeldBytes(job, rows);
}

absl::Status DynamicBatcher::QueueFullErrorLocked(
    int64_t rows, int64_t capacity, int64_t excess_rows, bool never,
    absl::string_view bound) const {
  absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
      "queue full: ", queued_rows_, " rows waiting + ", rows,
      " requested > the queue's bound of ", capacity, " rows (", bound, ")"));
  const std::map<std::string, std::string> metadata = {
      {"limit", absl::StrCat(capacity)},
      {"queued", absl::StrCat(queued_rows_)},
      {"requested", absl::StrCat(rows)}};
  // Rows that could never fit get no retry delay: waiting cannot help.
  if (never) {
    return v1::WithReason(std::move(status), v1::kReasonQueueFull, metadata);
  }
  return v1::WithReason(std::move(status), v1::kReasonQueueFull, metadata,
                        RetryDelayLocked(excess_rows));
}

absl::Duration DynamicBatcher::RetryDelayLocked(int64_t excess_rows) const {
  // Before the first batch there is no rate to go by: about one batch's wait.
  if (drain_rows_per_second_ <= 0) {
    return absl::Microseconds(options_.max_queue_delay_micros) +
           kDefaultRetryDelay;
  }
  const absl::Duration drain =
      absl::Seconds(static_cast<double>(excess_rows) / drain_rows_per_second_);
  return std::clamp(drain, kMinRetryDelay, kMaxRetryDelay);
}

void DynamicBatcher::NoteDrainRateLocked(int64_t rows, absl::Duration busy,
                                         int batches_running) {
  const double seconds = absl::ToDoubleSeconds(busy);
  if (rows <= 0 || seconds <= 0 || 2 * rows < options_.max_batch_rows) return;
  // Batches running side by side drain the queue together.
  const double rate =
      static_cast<double>(rows) / seconds * std::max(batches_running, 1);
  drain_rows_per_second_ = drain_rows_per_second_ <= 0
                               ? rate
                               : 0.75 * drain_rows_per_second_ + 0.25 * rate;
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
  stats.rows_queued = queued_rows_;
  stats.bytes_queued = queued_bytes_;
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

bool DynamicBatcher::ShouldWakeSleepingThread() const {
  // While one thread polls, it takes the next batch: waking a sleeper as
  // well would only cost the waker a system call.
  return stopping_ || (!thread_polling_ && CanStartBatchOrStopping());
}

bool DynamicBatcher::CanStartBatchOrStopping() const {
  if (stopping_) return true;
  if (queues_.empty()) return false;
  const int64_t overlap_rows = options_.min_rows_to_overlap >= 0
                                   ? options_.min_rows_to_overlap
                                   : options_.max_batch_rows / 4;
  return batches_in_flight_ == 0 || queued_rows_ >= overlap_rows;
}

void DynamicBatcher::SpinUntilBatchCanStartLocked() {
  if (options_.idle_spin_micros <= 0 || thread_polling_) return;
  thread_polling_ = true;
  // Wall time, not clock_: polling spends real CPU for a real span, and a
  // manual clock that nothing advances would keep a thread polling forever.
  const absl::Time give_up =
      absl::Now() + absl::Microseconds(options_.idle_spin_micros);
  while (!CanStartBatchOrStopping() && absl::Now() < give_up) {
    const uint64_t seen = state_version_.load(std::memory_order_acquire);
    mu_.Unlock();
    while (state_version_.load(std::memory_order_acquire) == seen &&
           absl::Now() < give_up) {
      CpuRelax();
    }
    mu_.Lock();
  }
  thread_polling_ = false;
}

bool DynamicBatcher::HasFullBatchOrStopping() const {
  return stopping_ || queued_rows_ >= options_.max_batch_rows;
}

DynamicBatcher::ModelQueue& DynamicBatcher::OldestQueueLocked() {
  auto oldest = queues_.begin();
  for (auto it = queues_.begin(); it != queues_.end(); ++it) {
    if (it->jobs.front().queued < oldest->jobs.front().queued) oldest = it;
  }
  return *oldest;
}

void DynamicBatcher::DropDeadJobsLocked(
    absl::Time now, std::vector<std::pair<Slice, absl::Status>>* dropped) {
  for (ModelQueue& queue : queues_) {
    for (auto it = queue.jobs.begin(); it != queue.jobs.end();) {
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
      DequeueRowsLocked(job, remaining);
      it = queue.jobs.erase(it);
    }
  }
  RemoveEmptyQueuesLocked();
}

void DynamicBatcher::RemoveEmptyQueuesLocked() {
  queues_.erase(
      std::remove_if(queues_.begin(), queues_.end(),
                     [](const ModelQueue& q) { return q.jobs.empty(); }),
      queues_.end());
}

std::vector<DynamicBatcher::Slice> DynamicBatcher::NextBatch() {
  std::vector<Slice> batch;
  std::vector<std::pair<Slice, absl::Status>> dropped;
  {
    absl::MutexLock lock(&mu_);
    while (batch.empty()) {
      SpinUntilBatchCanStartLocked();
      mu_.Await(
          absl::Condition(this, &DynamicBatcher::ShouldWakeSleepingThread));
      if (queues_.empty()) break;  // stopping, nothing left
      const absl::Time flush_at =
          OldestQueueLocked().jobs.front().queued +
          absl::Microseconds(options_.max_queue_delay_micros);
      // Await releases the lock even when it need not wait; skip it then.
      if (!HasFullBatchOrStopping() && clock_->Now() < flush_at) {
        clock_->AwaitWithDeadline(
            &mu_,
            absl::Condition(this, &DynamicBatcher::HasFullBatchOrStopping),
            flush_at);
      }
      DropDeadJobsLocked(clock_->Now(), &dropped);
      if (!queues_.empty()) {
        std::deque<QueuedJob>& jobs = OldestQueueLocked().jobs;
        int64_t room = options_.max_batch_rows;
        while (room > 0 && !jobs.empty()) {
          QueuedJob& front = jobs.front();
          const int64_t take =
              std::min(room, front.job->rows() - front.next_row);
          batch.push_back(Slice{front.job, front.next_row, take, front.queued});
          front.next_row += take;
          DequeueRowsLocked(*front.job, take);
          room -= take;
          if (front.next_row == front.job->rows()) jobs.pop_front();
        }
        RemoveEmptyQueuesLocked();
      }
      if (!batch.empty()) ++batches_in_flight_;
      if (!dropped.empty()) break;  // complete them without holding the lock
    }
  }
  for (auto& [slice, status] : dropped) {
    slice.job->FinishRows(slice.row_count, status);
  }
  return batch;
}

void DynamicBatcher::BatchLoop(LogpExecutor* executor) {
  while (true) {
    std::vector<Slice> batch = NextBatch();
    if (batch.empty()) {
      absl::MutexLock lock(&mu_);
      if (stopping_ && queues_.empty()) return;
      continue;
    }
    RunBatch(executor, batch);
  }
}

void DynamicBatcher::ScatterExtras(const LogpStaging& staging,
                                   int32_t batch_top_k, int64_t offset,
                                   const Slice& slice) {
  LogpJob& job = *slice.job;
  if (job.extras().entropy) {
    std::copy_n(staging.entropy + offset, slice.row_count,
                job.entropy().begin() + slice.row_begin);
  }
  // A row's top-k list for a smaller k is the prefix of the batch's.
  const int32_t k = job.extras().top_k;
  for (int64_t i = 0; k > 0 && i < slice.row_count; ++i) {
    const int64_t from = (offset + i) * batch_top_k;
    const int64_t to = (slice.row_begin + i) * k;
    std::copy_n(staging.top_ids + from, k, job.top_ids().begin() + to);
    std::copy_n(staging.top_logprobs + from, k,
                job.top_logprobs().begin() + to);
  }
}

void DynamicBatcher::FailBatch(std::vector<Slice>& batch,
                               const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    --batches_in_flight_;
    NotifyStateChangedLocked();
  }
  for (Slice& slice : batch) {
    rows_failed_.fetch_add(slice.row_count, std::memory_order_relaxed);
    slice.job->FinishRows(slice.row_count, status);
  }
}

void DynamicBatcher::RunBatch(LogpExecutor* executor,
                              std::vector<Slice>& batch) {
  const absl::Time gather_start = clock_->Now();
  const LogpModel& model = *batch.front().job->model();
  auto staged = executor->Stage(model);
  if (!staged.ok()) {
    FailBatch(batch, staged.status());
    return;
  }
  const LogpStaging staging = *staged;
  // The batch computes what any of its rows asks for; each row then takes
  // only its own (the extras are per-row quantities, so this costs bits
  // nothing).
  LogpExtras extras;
  for (const Slice& slice : batch) {
    extras.entropy = extras.entropy || slice.job->extras().entropy;
    extras.top_k = std::max(extras.top_k, slice.job->extras().top_k);
  }
  if ((extras.entropy && staging.entropy == nullptr) ||
      (extras.top_k > 0 &&
       (staging.top_ids == nullptr || staging.top_logprobs == nullptr))) {
    FailBatch(batch, absl::UnimplementedError(
                         "this backend does not compute entropy or top_k"));
    return;
  }
  // Rows in device memory only an executor that copies them itself can
  // read; anywhere else they fail their own request, not the batch.
  const auto unreadable = [executor](const Slice& slice) {
    return slice.job->hidden_location().kind == HiddenLocation::Kind::kDevice &&
           !executor->CopiesRowsFrom(HiddenLocation::Kind::kDevice);
  };
  for (Slice& slice : batch) {
    if (!unreadable(slice)) continue;
    rows_failed_.fetch_add(slice.row_count, std::memory_order_relaxed);
    slice.job->FinishRows(
        slice.row_count,
        v1::FieldError(absl::StatusCode::kFailedPrecondition,
                       "hidden.shared_memory",
                       "this backend cannot read device memory"));
  }
  batch.erase(std::remove_if(batch.begin(), batch.end(), unreadable),
              batch.end());
  if (batch.empty()) {
    absl::MutexLock lock(&mu_);
    --batches_in_flight_;
    NotifyStateChangedLocked();
    return;
  }
  // The slices whose rows made it into the staging, in staging order: a
  // region truncated by its owner under the gather fails its own slice,
  // and the scatter below walks only these.
  std::vector<Slice> gathered;
  gathered.reserve(batch.size());
  int64_t rows = 0;
  for (Slice& slice : batch) {
    const LogpJob& job = *slice.job;
    const int64_t row_bytes = job.hidden_size() * sizeof(uint16_t);
    const HiddenLocation& location = job.hidden_location();
    if (location.kind != HiddenLocation::Kind::kHost &&
        executor->CopiesRowsFrom(location.kind)) {
      // The executor's own copy (DMA from pinned pages, device to device)
      // involves no CPU read of the mapping.
      executor->CopyRows(location,
                         job.hidden_bf16() + slice.row_begin * row_bytes, rows,
                         slice.row_count);
    } else {
      char* destination =
          reinterpret_cast<char*>(staging.hidden) + rows * row_bytes;
      const size_t bytes = slice.row_count * row_bytes;
      if (!location.owner_may_truncate) {
        job.CopyHostRows(slice.row_begin, slice.row_count, destination);
      } else if (!CopyFromMapping(
                      destination,
                      job.hidden_bf16() + slice.row_begin * row_bytes, bytes)
                      .ok()) {
        // Its staging rows are taken by the next slice.
        rows_failed_.fetch_add(slice.row_count, std::memory_order_relaxed);
        slice.job->FinishRows(
            slice.row_count,
            RegionShrankError("hidden.shared_memory", location.region));
        continue;
      }
    }
    std::memcpy(staging.targets + rows, job.targets().data() + slice.row_begin,
                slice.row_count * sizeof(int32_t));
    std::fill_n(staging.temperatures + rows, slice.row_count,
                job.temperature());
    rows += slice.row_count;
    executor->RowsStaged(rows);
    gathered.push_back(std::move(slice));
  }
  batch.swap(gathered);
  if (batch.empty()) {
    absl::MutexLock lock(&mu_);
    --batches_in_flight_;
    NotifyStateChangedLocked();
    return;
  }
  const absl::Time start = clock_->Now();
  const absl::Status status = executor->Run(model, rows, extras);
  const absl::Time end = clock_->Now();
  {
    // The device is free for the next batch while this one's outputs are
    // scattered and its calls answered.
    absl::MutexLock lock(&mu_);
    if (status.ok())
      NoteDrainRateLocked(rows, end - gather_start, batches_in_flight_);
    --batches_in_flight_;
    NotifyStateChangedLocked();
  }
  if (options_.on_batch) {
    BatchRecord record;
    record.rows = rows;
    record.requests = static_cast<int64_t>(batch.size());
    record.queue_delay = gather_start - batch.front().queued;
    record.gather = start - gather_start;
    record.compute = end - start;
    record.ok = status.ok();
    options_.on_batch(record);
  }
  batches_run_.fetch_add(1, std::memory_order_relaxed);
  (status.ok() ? rows_computed_ : rows_failed_)
      .fetch_add(rows, std::memory_order_relaxed);
  int64_t offset = 0;
  for (Slice& slice : batch) {
    slice.job->NoteBatchRan(gather_start, end);
    if (status.ok()) {
      std::copy_n(staging.logprobs + offset, slice.row_count,
                  slice.job->logprobs().begin() + slice.row_begin);
      std::copy_n(staging.lse + offset, slice.row_count,
                  slice.job->lse().begin() + slice.row_begin);
      ScatterExtras(staging, extras.top_k, offset, slice);
    }
    offset += slice.row_count;
    slice.job->FinishRows(slice.row_count, status);
  }
}

}  // namespace detlogp::server
