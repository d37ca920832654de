#include "client/task_pool.h"

#include <algorithm>
#include <utility>

namespace detlogp::client {

TaskPool::TaskPool(int threads) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    threads_.emplace_back([this] { Work(); });
  }
}

TaskPool::~TaskPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void TaskPool::Schedule(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

void TaskPool::Work() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TaskPool* pool) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return pool->stopping_ || !pool->tasks_.empty();
          },
          this));
      if (tasks_.empty()) return;  // stopping, nothing left
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace detlogp::client
