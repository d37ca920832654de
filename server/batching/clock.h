// Clock: the time a DynamicBatcher reads and waits on.
//
// Production uses Clock::Real() (absl::Now and absl::Mutex's own timed
// wait). Tests pass a manual clock through DynamicBatcher::Options, so queue
// delays, deadlines and the batch timings behind the drain rate follow time
// the test sets instead of time that really passes.
//
// Example:
//   absl::MutexLock lock(&mu);
//   clock->AwaitWithDeadline(&mu, absl::Condition(&ready), clock->Now() + d);
#ifndef DETLOGP_SERVER_BATCHING_CLOCK_H_
#define DETLOGP_SERVER_BATCHING_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace detlogp::server {

class Clock {
 public:
  virtual ~Clock() = default;

  virtual absl::Time Now() = 0;

  // With `mu` held, waits (releasing `mu` meanwhile, as
  // absl::Mutex::AwaitWithDeadline does) until `condition` holds or this
  // clock reads `deadline` or later. Returns whether `condition` holds.
  virtual bool AwaitWithDeadline(absl::Mutex* mu,
                                 const absl::Condition& condition,
                                 absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;

  // The wall clock: absl::Now and absl::Mutex::AwaitWithDeadline. One
  // stateless instance shared by every user.
  static Clock* Real();
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BATCHING_CLOCK_H_
