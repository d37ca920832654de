#include "kernels/thread_pool.h"

#include <algorithm>

namespace detlogp::kernels {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads =
        static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  workers_.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::ParallelFor(int64_t count,
                             const std::function<void(int64_t)>& fn) {
  if (count <= 0) return;
  if (workers_.empty() || count == 1) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  uint64_t generation;
  {
    absl::MutexLock lock(&mu_);
    fn_ = &fn;
    count_ = count;
    next_ = 0;
    finished_ = 0;
    generation = ++generation_;
  }
  Drain(generation);
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &ThreadPool::LoopFinished));
  fn_ = nullptr;
}

void ThreadPool::Drain(uint64_t generation) {
  while (true) {
    int64_t index;
    const std::function<void(int64_t)>* fn;
    {
      absl::MutexLock lock(&mu_);
      if (generation_ != generation || next_ >= count_) return;
      index = next_++;
      fn = fn_;
    }
    (*fn)(index);
    absl::MutexLock lock(&mu_);
    ++finished_;
  }
}

void ThreadPool::WorkerLoop() {
  // The loop generation this worker last joined; a worker wakes for a newer
  // loop that still has unclaimed indices, or to stop.
  struct Wakeup {
    const ThreadPool* pool;
    uint64_t seen;
    bool Ready() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return pool->stopping_ ||
             (pool->generation_ != seen && pool->next_ < pool->count_);
    }
  };
  Wakeup wakeup{this, 0};
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&wakeup, &Wakeup::Ready));
      if (stopping_) return;
      wakeup.seen = generation_;
    }
    Drain(wakeup.seen);
  }
}

}  // namespace detlogp::kernels
