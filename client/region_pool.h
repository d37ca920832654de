// Shared-memory regions a client owns, each lent to one call at a time, so
// that calls made at once overlap instead of taking turns on one region.
//
//   RegionPool<SystemRegion> pool(/*capacity=*/4);
//   RegionPool<SystemRegion>::Lease lease = *pool.Take(bytes);
//   if (lease.get() == nullptr) lease.Set(MakeRegion(bytes));  // a new one
//   ... fill it, name it in the requests ...
//   // the lease's destructor gives the region back for the next call
//
// A call takes an idle region of at least its bytes when there is one, else
// any idle one (the caller grows it), else a free slot for a new region;
// with `capacity` regions lent it waits for one. A region is made only when
// none is idle, so the pool never holds more than `capacity` regions, lent
// and idle. Region is any type with `int64_t bytes() const`.
#ifndef DETLOGP_CLIENT_REGION_POOL_H_
#define DETLOGP_CLIENT_REGION_POOL_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace detlogp::client {

template <typename Region>
class RegionPool {
 public:
  // One call's hold on a region (or on a slot for one). Gives it back when
  // destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)),
          region_(std::move(other.region_)) {}
    Lease& operator=(Lease&& other) noexcept {
      if (this != &other) {
        Release();
        pool_ = std::exchange(other.pool_, nullptr);
        region_ = std::move(other.region_);
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { Release(); }

    // The lent region; null for a slot the caller fills with Set.
    Region* get() const { return region_.get(); }
    // The region made (or remade larger) for this lease.
    void Set(std::unique_ptr<Region> region) { region_ = std::move(region); }
    // The lent region, to give up (its server copy is gone, or it is too
    // small): the lease keeps its slot, empty.
    std::unique_ptr<Region> Take() { return std::move(region_); }

   private:
    friend class RegionPool;
    Lease(RegionPool* pool, std::unique_ptr<Region> region)
        : pool_(pool), region_(std::move(region)) {}
    void Release() {
      if (pool_ != nullptr) pool_->GiveBack(std::move(region_));
      pool_ = nullptr;
    }
    RegionPool* pool_ = nullptr;
    std::unique_ptr<Region> region_;
  };

  explicit RegionPool(int capacity) : capacity_(std::max(capacity, 1)) {}
  RegionPool(const RegionPool&) = delete;
  RegionPool& operator=(const RegionPool&) = delete;

  // A region for a call of `bytes`; waits while every slot is lent, until
  // `deadline` (then nullopt).
  std::optional<Lease> Take(int64_t bytes,
                            absl::Time deadline = absl::InfiniteFuture()) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithDeadline(absl::Condition(this, &RegionPool::HasRoom),
                               deadline)) {
      return std::nullopt;
    }
    ++lent_;
    if (idle_.empty()) return Lease(this, nullptr);
    // The smallest idle region that holds the call, else the largest (the
    // caller grows it).
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      const bool fits = (*it)->bytes() >= bytes;
      if (best == idle_.end()) {
        best = it;
      } else if (fits && ((*best)->bytes() < bytes ||
                          (*it)->bytes() < (*best)->bytes())) {
        best = it;
      } else if (!fits && (*best)->bytes() < bytes &&
                 (*it)->bytes() > (*best)->bytes()) {
        best = it;
      }
    }
    std::unique_ptr<Region> region = std::move(*best);
    idle_.erase(best);
    return Lease(this, std::move(region));
  }

  // When other calls hold regions, lowers the slots to theirs and says
  // true: the server refused the asker one more region, so after giving
  // its lease back it waits for one of theirs. False when the asker is
  // alone.
  bool ShrinkToOthersLent() {
    absl::MutexLock lock(&mu_);
    if (lent_ <= 1) return false;
    capacity_ = lent_ - 1;
    return true;
  }

  // The slots now (lowered by ShrinkToOthersLent).
  int capacity() const {
    absl::MutexLock lock(&mu_);
    return capacity_;
  }

  // The idle regions, taken out (to release them at shutdown).
  std::vector<std::unique_ptr<Region>> TakeIdle() {
    absl::MutexLock lock(&mu_);
    return std::exchange(idle_, {});
  }

 private:
  bool HasRoom() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return lent_ < capacity_;
  }
  void GiveBack(std::unique_ptr<Region> region) {
    absl::MutexLock lock(&mu_);
    --lent_;
    if (region != nullptr) idle_.push_back(std::move(region));
  }

  mutable absl::Mutex mu_;
  int capacity_ ABSL_GUARDED_BY(mu_);
  int lent_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<Region>> idle_ ABSL_GUARDED_BY(mu_);
};

// How a client makes, releases and judges its regions of one kind, for
// LeaseRegion.
template <typename Region>
struct RegionMaker {
  // A new region of at least `bytes`, registered with the server.
  std::function<absl::StatusOr<std::unique_ptr<Region>>(int64_t bytes)> make;
  // Unregisters a region the client gives up.
  std::function<void(const Region&)> release;
  // Whether a failure of `make` is the server refusing the region (the
  // rows then take another path) rather than an error of the call.
  std::function<bool(const absl::Status&)> is_refusal;
};

// A region of at least `bytes` from `pool` for one call, the policy both
// region kinds follow: an idle region that holds the rows, else one made
// (or an idle one made again larger); with every slot lent, a wait until
// `deadline` (then DEADLINE_EXCEEDED naming `what`). A region the server
// refuses while other calls hold regions lowers the slots to theirs and
// the call waits for one of them; refused after releasing the idle ones,
// with no other call holding any, it is the pool's refusal: nullopt, with
// `*refusal` set to the server's status (the caller turns the path off).
template <typename Region>
absl::StatusOr<std::optional<typename RegionPool<Region>::Lease>> LeaseRegion(
    RegionPool<Region>& pool, int64_t bytes, absl::Time deadline,
    const RegionMaker<Region>& maker, absl::string_view what,
    absl::Status* refusal) {
  while (true) {
    std::optional<typename RegionPool<Region>::Lease> taken =
        pool.Take(bytes, deadline);
    if (!taken.has_value()) {
      return absl::DeadlineExceededError(
          absl::StrCat(what,
                       ": every region of the client's was in use until the "
                       "call's deadline"));
    }
    typename RegionPool<Region>::Lease lease = *std::move(taken);
    if (lease.get() != nullptr && lease.get()->bytes() < bytes) {
      maker.release(*lease.Take());  // made again, larger
    }
    if (lease.get() == nullptr) {
      absl::StatusOr<std::unique_ptr<Region>> made = maker.make(bytes);
      if (!made.ok()) {
        if (!maker.is_refusal(made.status())) return made.status();
        // The server's bound may be held by other calls' regions (wait for
        // one of theirs) or by idle ones (release them).
        if (pool.ShrinkToOthersLent()) continue;
        std::vector<std::unique_ptr<Region>> idle = pool.TakeIdle();
        for (const auto& region : idle) maker.release(*region);
        if (!idle.empty()) continue;
        *refusal = made.status();
        return std::nullopt;
      }
      lease.Set(*std::move(made));
    }
    return std::optional<typename RegionPool<Region>::Lease>(std::move(lease));
  }
}

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_REGION_POOL_H_
