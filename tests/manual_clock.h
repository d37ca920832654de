// ManualClock: a batcher Clock whose time moves only when a test moves it.
//
// Now() reads the time the test set; Advance(d) moves it forward and wakes
// every waiter whose deadline it reached. A wait returns as soon as its
// condition holds (the waited-on mutex is released by whoever changed it,
// as with absl::Mutex) or once the clock reaches its deadline, however
// little real time passed. Nothing here sleeps.
//
// Example:
//   ManualClock clock;
//   options.clock = &clock;
//   ... schedule a partial batch ...
//   ASSERT_TRUE(clock.WaitForWaiters(1));   // the batcher waits to flush
//   clock.Advance(absl::Microseconds(options.max_queue_delay_micros));
#ifndef DETLOGP_TESTS_MANUAL_CLOCK_H_
#define DETLOGP_TESTS_MANUAL_CLOCK_H_

#include <algorithm>
#include <atomic>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/batching/clock.h"

namespace detlogp::testing {

class ManualClock final : public server::Clock {
 public:
  // An arbitrary start, far from the epoch so that `Now() - d` stays sane.
  explicit ManualClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000))
      : start_(start) {}
  ManualClock(const ManualClock&) = delete;
  ManualClock& operator=(const ManualClock&) = delete;

  absl::Time Now() override {
    // Atomic, not under waiters_mu_: waiters read it inside an
    // absl::Condition, which must not block.
    return start_ + absl::Nanoseconds(elapsed_ns_.load());
  }

  // Moves the clock forward by `d` (>= 0) and wakes the waiters whose
  // deadline it reached. Call it without holding a mutex a waiter waits on,
  // and not while another thread destroys the owner of such a mutex (it
  // locks the mutexes it saw waited on).
  void Advance(absl::Duration d) {
    std::vector<absl::Mutex*> waited_on;
    {
      absl::MutexLock lock(&waiters_mu_);
      elapsed_ns_.fetch_add(absl::ToInt64Nanoseconds(d));
      waited_on = waited_on_;
    }
    // Releasing a mutex makes absl::Mutex evaluate its waiters' conditions,
    // which read the new time. Outside waiters_mu_: a waiter holds its
    // mutex when it takes waiters_mu_.
    std::sort(waited_on.begin(), waited_on.end());
    waited_on.erase(std::unique(waited_on.begin(), waited_on.end()),
                    waited_on.end());
    for (absl::Mutex* mu : waited_on) {
      mu->Lock();
      mu->Unlock();
    }
  }

  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                         absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    {
      absl::MutexLock lock(&waiters_mu_);
      waited_on_.push_back(mu);
    }
    WaitArgs args{this, &condition, deadline};
    mu->Await(absl::Condition(&ConditionOrDeadline, &args));
    {
      absl::MutexLock lock(&waiters_mu_);
      waited_on_.erase(std::find(waited_on_.begin(), waited_on_.end(), mu));
    }
    return condition.Eval();
  }

  // Blocks until at least `count` threads wait on this clock (a batch
  // thread waiting to flush a partial batch, say); false if that does not
  // happen within `timeout` of real time, a guard against hanging.
  bool WaitForWaiters(int count, absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock lock(&waiters_mu_);
    WaitersArgs args{this, count};
    return waiters_mu_.AwaitWithTimeout(absl::Condition(&EnoughWaiters, &args),
                                        timeout);
  }

  int waiters() {
    absl::MutexLock lock(&waiters_mu_);
    return static_cast<int>(waited_on_.size());
  }

 private:
  struct WaitArgs {
    ManualClock* clock;
    const absl::Condition* condition;
    absl::Time deadline;
  };
  static bool ConditionOrDeadline(WaitArgs* args) {
    return args->condition->Eval() || args->clock->Now() >= args->deadline;
  }
  struct WaitersArgs {
    ManualClock* clock;
    int count;
  };
  static bool EnoughWaiters(WaitersArgs* args)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {  // evaluated under waiters_mu_
    return static_cast<int>(args->clock->waited_on_.size()) >= args->count;
  }

  const absl::Time start_;
  std::atomic<int64_t> elapsed_ns_{0};
  absl::Mutex waiters_mu_;
  // The mutex of each waiter, once per waiter.
  std::vector<absl::Mutex*> waited_on_ ABSL_GUARDED_BY(waiters_mu_);
};

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_MANUAL_CLOCK_H_
