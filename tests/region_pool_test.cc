// The client's pool of shared-memory regions: which idle region a call gets,
// the bound on regions lent at once, and the bound lowered when the server
// refuses one more.
#include "client/region_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace detlogp::client {
namespace {

struct FakeRegion {
  int64_t size = 0;
  int64_t bytes() const { return size; }
};

using Pool = RegionPool<FakeRegion>;

std::unique_ptr<FakeRegion> Region(int64_t size) {
  return std::make_unique<FakeRegion>(FakeRegion{size});
}

// Leaves regions of `sizes` idle in `pool`.
void MakeIdle(Pool& pool, const std::vector<int64_t>& sizes) {
  std::vector<Pool::Lease> leases;
  for (int64_t size : sizes) {
    leases.push_back(*pool.Take(size));
    EXPECT_EQ(leases.back().get(), nullptr);
    leases.back().Set(Region(size));
  }
}

TEST(RegionPoolTest, AnEmptyPoolLendsASlotAndKeepsWhatIsMadeForIt) {
  Pool pool(2);
  {
    Pool::Lease lease = *pool.Take(100);
    EXPECT_EQ(lease.get(), nullptr);
    lease.Set(Region(128));
  }
  Pool::Lease again = *pool.Take(50);
  ASSERT_NE(again.get(), nullptr);
  EXPECT_EQ(again.get()->bytes(), 128);
}

TEST(RegionPoolTest, ACallGetsTheSmallestIdleRegionThatHoldsIt) {
  Pool pool(4);
  MakeIdle(pool, {64, 512, 256, 1024});
  Pool::Lease a = *pool.Take(200);
  Pool::Lease b = *pool.Take(200);
  Pool::Lease c = *pool.Take(200);
  ASSERT_NE(a.get(), nullptr);
  ASSERT_NE(b.get(), nullptr);
  ASSERT_NE(c.get(), nullptr);
  EXPECT_EQ(a.get()->bytes(), 256);
  EXPECT_EQ(b.get()->bytes(), 512);
  EXPECT_EQ(c.get()->bytes(), 1024);
  // None left that holds it: the largest, for the caller to grow.
  Pool::Lease d = *pool.Take(200);
  ASSERT_NE(d.get(), nullptr);
  EXPECT_EQ(d.get()->bytes(), 64);
}

TEST(RegionPoolTest, WithNoIdleRegionThatHoldsItTheLargestIsLent) {
  Pool pool(3);
  MakeIdle(pool, {64, 256, 128});
  Pool::Lease lease = *pool.Take(1000);
  ASSERT_NE(lease.get(), nullptr);
  EXPECT_EQ(lease.get()->bytes(), 256);
}

TEST(RegionPoolTest, ARegionGivenUpFreesItsSlotEmpty) {
  Pool pool(1);
  MakeIdle(pool, {64});
  {
    Pool::Lease lease = *pool.Take(64);
    std::unique_ptr<FakeRegion> gone = lease.Take();
    ASSERT_NE(gone, nullptr);
  }
  Pool::Lease next = *pool.Take(64);
  EXPECT_EQ(next.get(), nullptr);
  EXPECT_TRUE(pool.TakeIdle().empty());
}

TEST(RegionPoolTest, ACallBeyondTheCapacityWaitsForALease) {
  Pool pool(2);
  Pool::Lease first = *pool.Take(1);
  first.Set(Region(10));
  Pool::Lease second = *pool.Take(1);
  std::atomic<bool> taken{false};
  int64_t got = 0;
  std::thread third([&] {
    Pool::Lease lease = *pool.Take(1);
    got = lease.get() != nullptr ? lease.get()->bytes() : -1;
    taken.store(true);
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(taken.load());
  first = Pool::Lease();  // gives the region back
  third.join();
  EXPECT_TRUE(taken.load());
  EXPECT_EQ(got, 10);
}

TEST(RegionPoolTest, ACallBeyondTheCapacityGivesUpAtItsDeadline) {
  Pool pool(1);
  Pool::Lease held = *pool.Take(1);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(pool.Take(1, start + absl::Milliseconds(50)).has_value());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  held = Pool::Lease();
  EXPECT_TRUE(pool.Take(1, absl::Now() + absl::Seconds(5)).has_value());
}

TEST(RegionPoolTest, ARefusalWithOthersLentLowersTheCapacityToTheirs) {
  Pool pool(4);
  {
    Pool::Lease alone = *pool.Take(1);
    EXPECT_FALSE(pool.ShrinkToOthersLent());
  }
  Pool::Lease held = *pool.Take(1);
  held.Set(Region(8));
  {
    Pool::Lease refused = *pool.Take(1);
    EXPECT_EQ(refused.get(), nullptr);
    EXPECT_TRUE(pool.ShrinkToOthersLent());
  }
  // One slot now: the next call waits for the held region.
  std::atomic<bool> taken{false};
  std::thread next([&] {
    Pool::Lease lease = *pool.Take(1);
    EXPECT_NE(lease.get(), nullptr);
    taken.store(true);
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(taken.load());
  held = Pool::Lease();
  next.join();
  EXPECT_TRUE(taken.load());
}

TEST(RegionPoolTest, ManyThreadsNeverHoldMoreThanTheCapacity) {
  Pool pool(3);
  std::atomic<int> holding{0};
  std::atomic<int> most{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        Pool::Lease lease = *pool.Take(1 + (t + i) % 5);
        const int now = holding.fetch_add(1) + 1;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        if (lease.get() == nullptr || lease.get()->bytes() < 1 + (t + i) % 5) {
          lease.Set(Region(1 + (t + i) % 5));
        }
        holding.fetch_sub(1);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_LE(most.load(), 3);
  EXPECT_LE(pool.TakeIdle().size(), 3u);
}

// LeaseRegion's policy against a fake server: `make` fails with
// RESOURCE_EXHAUSTED while `refuse` is set (or with `error` when set), and
// every make and release is counted.
class FakeMaker {
 public:
  std::atomic<bool> refuse{false};
  absl::Status error;
  std::atomic<int> made{0};
  std::atomic<int> released{0};
  absl::Notification refused_once;  // the first refusal was given

  RegionMaker<FakeRegion> maker() {
    RegionMaker<FakeRegion> maker;
    maker.make =
        [this](int64_t bytes) -> absl::StatusOr<std::unique_ptr<FakeRegion>> {
      if (!error.ok()) return error;
      if (refuse.load()) {
        // Makers run side by side: exactly one of them notifies.
        if (!refusing_.exchange(true)) refused_once.Notify();
        return absl::ResourceExhaustedError("over the server's bound");
      }
      ++made;
      return Region(bytes);
    };
    maker.release = [this](const FakeRegion&) { ++released; };
    maker.is_refusal = [](const absl::Status& status) {
      return status.code() == absl::StatusCode::kResourceExhausted;
    };
    return maker;
  }

 private:
  std::atomic<bool> refusing_{false};
};

absl::StatusOr<std::optional<Pool::Lease>> Lease(
    Pool& pool, int64_t bytes, FakeMaker& fake, absl::Status* refusal,
    absl::Time deadline = absl::InfiniteFuture()) {
  return LeaseRegion(pool, bytes, deadline, fake.maker(), "fake", refusal);
}

TEST(LeaseRegionTest, CallsAtOnceEachHoldARegionOfTheirOwn) {
  Pool pool(4);
  FakeMaker fake;
  absl::Status refusal;
  std::vector<Pool::Lease> held;
  for (int call = 0; call < 3; ++call) {
    auto lease = Lease(pool, 100, fake, &refusal);
    ASSERT_TRUE(lease.ok() && lease->has_value());
    held.push_back(**std::move(lease));
  }
  EXPECT_EQ(fake.made.load(), 3);
  EXPECT_NE(held[0].get(), held[1].get());
  EXPECT_NE(held[1].get(), held[2].get());
  held.clear();
  // Kept: a later call of no more bytes takes one, nothing is made.
  auto again = Lease(pool, 50, fake, &refusal);
  ASSERT_TRUE(again.ok() && again->has_value());
  EXPECT_EQ(fake.made.load(), 3);
  EXPECT_TRUE(refusal.ok());
}

TEST(LeaseRegionTest, AnIdleRegionTooSmallIsMadeAgainLarger) {
  Pool pool(4);
  FakeMaker fake;
  absl::Status refusal;
  { auto small = Lease(pool, 10, fake, &refusal); }
  auto large = Lease(pool, 1000, fake, &refusal);
  ASSERT_TRUE(large.ok() && large->has_value());
  EXPECT_EQ((**large).get()->bytes(), 1000);
  EXPECT_EQ(fake.made.load(), 2);
  EXPECT_EQ(fake.released.load(), 1);
}

TEST(LeaseRegionTest, ARefusalWhileOthersHoldRegionsWaitsForOneOfThem) {
  Pool pool(4);
  FakeMaker fake;
  absl::Status refusal;
  auto first = Lease(pool, 100, fake, &refusal);
  ASSERT_TRUE(first.ok() && first->has_value());
  FakeRegion* const first_region = (**first).get();
  fake.refuse = true;
  absl::StatusOr<std::optional<Pool::Lease>> second =
      absl::UnknownError("not run");
  std::thread call([&] { second = Lease(pool, 100, fake, &refusal); });
  // Refused while the first call holds its region, the second lowers the
  // slots to the first's and waits for its region.
  fake.refused_once.WaitForNotification();
  while (pool.capacity() != 1) std::this_thread::yield();
  first->reset();
  call.join();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(second->has_value());
  EXPECT_EQ((**second).get(), first_region);
  EXPECT_TRUE(refusal.ok()) << refusal;
}

TEST(LeaseRegionTest, ARefusalAloneReleasesIdleRegionsThenIsThePoolsRefusal) {
  Pool pool(4);
  FakeMaker fake;
  absl::Status refusal;
  {
    auto a = Lease(pool, 10, fake, &refusal);
    auto b = Lease(pool, 10, fake, &refusal);
  }
  fake.refuse = true;
  auto refused = Lease(pool, 1000, fake, &refusal);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_FALSE(refused->has_value());
  EXPECT_EQ(refusal.code(), absl::StatusCode::kResourceExhausted);
  // Both idle regions were given up before the refusal counted.
  EXPECT_EQ(fake.released.load(), 2);
  EXPECT_TRUE(pool.TakeIdle().empty());
}

TEST(LeaseRegionTest, AnotherErrorIsTheCallsAndEveryRegionLentIsADeadline) {
  Pool pool(1);
  FakeMaker fake;
  absl::Status refusal;
  fake.error = absl::InternalError("allocation failed");
  auto failed = Lease(pool, 10, fake, &refusal);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(refusal.ok());
  fake.error = absl::OkStatus();
  auto held = Lease(pool, 10, fake, &refusal);
  ASSERT_TRUE(held.ok() && held->has_value());
  auto waited =
      Lease(pool, 10, fake, &refusal, absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StartsWith(waited.status().message(), "fake: "))
      << waited.status();
}

}  // namespace
}  // namespace detlogp::client
