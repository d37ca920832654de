#include "server/batching/clock.h"

#include "absl/time/clock.h"

namespace detlogp::server {
namespace {

class RealClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                         absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return mu->AwaitWithDeadline(condition, deadline);
  }
};

}  // namespace

Clock* Clock::Real() {
  // Stateless, so sharing it between batchers and threads is safe; never
  // destroyed, so it outlives every batcher.
  static RealClock* const clock = new RealClock;
  return clock;
}

}  // namespace detlogp::server
