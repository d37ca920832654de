// Threads for work that must not run on gRPC's callback threads: loading a
// model takes seconds, an upload hashes and writes a gigabyte. Each task gets
// its own thread (admin calls are rare); the destructor joins them all, so
// no task outlives the service that started it.
#ifndef DETLOGP_SERVER_TRANSPORT_BACKGROUND_TASKS_H_
#define DETLOGP_SERVER_TRANSPORT_BACKGROUND_TASKS_H_

#include <atomic>
#include <list>
#include <memory>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace detlogp::server {

class BackgroundTasks {
 public:
  BackgroundTasks() = default;
  ~BackgroundTasks() {
    std::list<Task> tasks;
    {
      absl::MutexLock lock(&mu_);
      tasks.swap(tasks_);
    }
    for (Task& task : tasks) task.thread.join();
  }
  BackgroundTasks(const BackgroundTasks&) = delete;
  BackgroundTasks& operator=(const BackgroundTasks&) = delete;

  void Start(absl::AnyInvocable<void()> fn) {
    std::list<Task> finished;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = tasks_.begin(); it != tasks_.end();) {
        auto next = std::next(it);
        if (it->done->load()) finished.splice(finished.end(), tasks_, it);
        it = next;
      }
      Task& task = tasks_.emplace_back();
      task.done = std::make_shared<std::atomic<bool>>(false);
      task.thread =
          std::thread([fn = std::move(fn), done = task.done]() mutable {
            fn();
            done->store(true);
          });
    }
    // Their functions have returned; joining is immediate.
    for (Task& task : finished) task.thread.join();
  }

 private:
  struct Task {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  absl::Mutex mu_;
  std::list<Task> tasks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_BACKGROUND_TASKS_H_
