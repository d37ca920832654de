// A fixed set of threads running tasks in the order they were scheduled.
// The large-call engine writes requests' bytes on it, so that the copies
// of a call's requests into gRPC's buffers run side by side on a bounded
// number of threads instead of one thread per request or per call.
#ifndef DETLOGP_CLIENT_TASK_POOL_H_
#define DETLOGP_CLIENT_TASK_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace detlogp::client {

class TaskPool {
 public:
  // At least one thread.
  explicit TaskPool(int threads);
  // Runs the tasks already scheduled, then joins.
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  void Schedule(std::function<void()> task);
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Work();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_TASK_POOL_H_
