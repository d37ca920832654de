#include "tests/manual_clock.h"

#include <thread>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace detlogp::testing {
namespace {

TEST(ManualClockTest, NowMovesOnlyWhenAdvanced) {
  ManualClock clock(absl::FromUnixSeconds(100));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100));
  clock.Advance(absl::Milliseconds(1500));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100) + absl::Milliseconds(1500));
}

TEST(ManualClockTest, AWaitEndsWhenTheClockReachesItsDeadline) {
  ManualClock clock;
  absl::Mutex mu;
  bool ready = false;
  const absl::Time deadline = clock.Now() + absl::Seconds(5);
  absl::Notification returned;
  bool condition_held = true;
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    condition_held =
        clock.AwaitWithDeadline(&mu, absl::Condition(&ready), deadline);
    returned.Notify();
  });
  ASSERT_TRUE(clock.WaitForWaiters(1));
  clock.Advance(absl::Seconds(5) - absl::Nanoseconds(1));
  EXPECT_EQ(clock.waiters(), 1);  // still waiting
  EXPECT_FALSE(returned.HasBeenNotified());
  clock.Advance(absl::Nanoseconds(1));
  ASSERT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(10)));
  waiter.join();
  EXPECT_FALSE(condition_held);
  EXPECT_EQ(clock.waiters(), 0);
}

TEST(ManualClockTest, AWaitEndsWhenItsConditionHolds) {
  ManualClock clock;
  absl::Mutex mu;
  bool ready = false;
  bool condition_held = false;
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    condition_held = clock.AwaitWithDeadline(&mu, absl::Condition(&ready),
                                             absl::InfiniteFuture());
  });
  ASSERT_TRUE(clock.WaitForWaiters(1));
  {
    absl::MutexLock lock(&mu);
    ready = true;
  }
  waiter.join();  // no time passed
  EXPECT_TRUE(condition_held);
  EXPECT_EQ(clock.waiters(), 0);
}

TEST(ManualClockTest, AWaitWhoseDeadlinePassedReturnsAtOnce) {
  ManualClock clock;
  absl::Mutex mu;
  bool ready = false;
  absl::MutexLock lock(&mu);
  EXPECT_FALSE(
      clock.AwaitWithDeadline(&mu, absl::Condition(&ready), clock.Now()));
}

}  // namespace
}  // namespace detlogp::testing
