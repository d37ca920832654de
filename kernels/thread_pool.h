// A fixed pool of worker threads for data-parallel loops in CPU kernels.
//
// Work is handed out in index order, but which thread runs an index is up to
// timing; kernels only use it for work whose result is independent of the
// thread that computes it (each index writes its own outputs).
#ifndef DETLOGP_KERNELS_THREAD_POOL_H_
#define DETLOGP_KERNELS_THREAD_POOL_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace detlogp::kernels {

class ThreadPool {
 public:
  // `num_threads` <= 0 means one per hardware thread.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, count) and returns when all are done. The
  // calling thread takes part. Not reentrant: one loop at a time per pool.
  void ParallelFor(int64_t count, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  // Claims and runs indices of the current loop until none are left.
  void Drain(uint64_t generation);
  bool LoopFinished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return finished_ == count_;
  }

  absl::Mutex mu_;
  const std::function<void(int64_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_THREAD_POOL_H_
