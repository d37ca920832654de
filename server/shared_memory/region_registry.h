// SharedMemoryRegistry holds the shared-memory regions clients on the same
// host registered (Triton's shared-memory extensions): system regions (a
// POSIX shared-memory object, mapped read-only once) and CUDA regions (a
// cudaIpcMemHandle_t, opened once on its GPU). Requests then name
// {region, offset, byte_size} instead of carrying their bytes.
//
// Rules it keeps:
//   - Names are unique over both kinds. A region belongs to the token that
//     registered it (`owner`, empty without bearer tokens): other owners
//     neither see nor use it (NOT_FOUND for them, as if absent).
//   - The bytes registered by every owner together stay within
//     Options::max_bytes (RESOURCE_EXHAUSTED beyond it).
//   - A request holds a Lease while it reads a region; Unregister refuses
//     with FAILED_PRECONDITION while leases are out, and memory is unmapped
//     only when the last lease ends, so bytes never vanish under a request.
//   - A system region's owner may truncate its object at any time: a
//     request is refused (FAILED_PRECONDITION naming `field`) when the
//     object no longer holds the region at Acquire, and its Lease's location
//     says owner_may_truncate, so the server reads it only through
//     CopyFromMapping (mapped_reads.h), which turns a later truncation
//     into a status instead of a SIGBUS.
//   - A region neither registered nor named by a request for
//     Options::idle_release is released by a background sweep, so a client
//     killed without unregistering leaks nothing for long.
//
// The registry knows no CUDA: pinning host memory and opening IPC handles
// are hooks (Options) the server fills from its backend.
//
// Example:
//   auto registry = SharedMemoryRegistry::Create(options);
//   (*registry)->RegisterSystem("", "rows", "/my_shm", 0, 1 << 20);
//   auto lease = (*registry)->Acquire("", "rows", offset, bytes,
//                                     "hidden.shared_memory");
//   // read lease->data() .. lease->data() + bytes through CopyFromMapping
#ifndef DETLOGP_SERVER_SHARED_MEMORY_REGION_REGISTRY_H_
#define DETLOGP_SERVER_SHARED_MEMORY_REGION_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backends/hidden_location.h"

namespace detlogp::server {

enum class RegionKind { kSystem, kCuda };

class SharedMemoryRegistry {
 public:
  struct Options {
    // Bytes all regions of all owners may hold together; > 0.
    int64_t max_bytes = int64_t{64} << 30;
    // A region unused this long is released; zero: never.
    absl::Duration idle_release = absl::Seconds(300);
    // How often the sweep looks; zero: a quarter of idle_release, between
    // 10 ms and 5 s.
    absl::Duration sweep_interval = absl::ZeroDuration();
    // Makes a mapped system region a direct copy source for the backend;
    // returns whether it did (empty: never).
    std::function<bool(void* data, int64_t bytes)> pin_host;
    std::function<void(void* data)> unpin_host;
    // Opens a CUDA IPC handle on `device`, checking `byte_size` (empty:
    // CUDA regions are refused with FAILED_PRECONDITION).
    std::function<absl::StatusOr<void*>(const std::string& raw_handle,
                                        int device, int64_t byte_size)>
        open_ipc;
    std::function<void(void* data, int device)> close_ipc;
    // Test hook; empty: absl::Now.
    std::function<absl::Time()> clock;
  };

  // How a region has been used (SharedMemoryUse in the API).
  struct Use {
    int64_t requests_in_flight = 0;
    int64_t requests = 0;
    int64_t bytes_read = 0;
    absl::Time last_use;
  };

  struct RegionStatus {
    std::string name;
    RegionKind kind = RegionKind::kSystem;
    std::string key;     // system: the shm_open name
    int64_t offset = 0;  // system: where the region starts in the object
    int device = -1;     // CUDA
    int64_t byte_size = 0;
    bool pinned = false;  // system: the backend copies from it directly
    Use use;
  };

  struct Totals {
    int64_t system_regions = 0;
    int64_t system_bytes = 0;
    int64_t cuda_regions = 0;
    int64_t cuda_bytes = 0;
    int64_t idle_released = 0;  // regions released by the sweep
  };

  class Region;

  // A request's hold on `byte_size` bytes of a region: the region stays
  // mapped and counts the request as in flight until the Lease is gone.
  class Lease {
   public:
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    const char* data() const { return data_; }
    const HiddenLocation& location() const { return location_; }

   private:
    friend class SharedMemoryRegistry;
    Lease(SharedMemoryRegistry* registry, std::shared_ptr<Region> region,
          const char* data, HiddenLocation location)
        : registry_(registry),
          region_(std::move(region)),
          data_(data),
          location_(location) {}
    SharedMemoryRegistry* const registry_;
    const std::shared_ptr<Region> region_;
    const char* const data_;
    const HiddenLocation location_;
  };

  static absl::StatusOr<std::unique_ptr<SharedMemoryRegistry>> Create(
      Options options);
  // Stops the sweep; regions are released once their leases are gone (the
  // registry must outlive every Lease).
  ~SharedMemoryRegistry();
  SharedMemoryRegistry(const SharedMemoryRegistry&) = delete;
  SharedMemoryRegistry& operator=(const SharedMemoryRegistry&) = delete;

  // Maps bytes [offset, offset + byte_size) of the POSIX shared-memory
  // object `key` read-only. INVALID_ARGUMENT naming name, key, offset or
  // byte_size; NOT_FOUND when no object `key` can be opened;
  // ALREADY_EXISTS for a name in use; RESOURCE_EXHAUSTED beyond max_bytes.
  absl::Status RegisterSystem(const std::string& owner, const std::string& name,
                              const std::string& key, int64_t offset,
                              int64_t byte_size);
  // Opens a CUDA IPC handle through Options::open_ipc.
  absl::Status RegisterCuda(const std::string& owner, const std::string& name,
                            const std::string& raw_handle, int64_t device_id,
                            int64_t byte_size);
  // Releases `owner`'s region `name` of `kind`, or every one of its regions
  // of `kind` when `name` is empty (all or none: FAILED_PRECONDITION, and
  // nothing released, while any is in use).
  absl::Status Unregister(const std::string& owner, RegionKind kind,
                          const std::string& name);
  // `owner`'s regions of `kind` (or region `name`: NOT_FOUND when absent),
  // sorted by name.
  absl::StatusOr<std::vector<RegionStatus>> List(const std::string& owner,
                                                 RegionKind kind,
                                                 const std::string& name) const;

  // Bytes [offset, offset + byte_size) of `owner`'s region `region`.
  // INVALID_ARGUMENT or NOT_FOUND naming `field`.region, .offset or
  // .byte_size; FAILED_PRECONDITION naming `field` when the owner truncated
  // a system region's object below the region.
  absl::StatusOr<std::shared_ptr<const Lease>> Acquire(
      const std::string& owner, const std::string& region, int64_t offset,
      int64_t byte_size, absl::string_view field);

  // Releases regions idle for idle_release (the sweep calls it); returns
  // how many.
  int ReleaseIdle();

  Totals totals() const;
  const Options& options() const { return options_; }

  // ---- Implementation details; API users need not read further. ----
 private:
  explicit SharedMemoryRegistry(Options options);

  absl::Status CheckNewRegion(const std::string& name, int64_t byte_size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Insert(std::shared_ptr<Region> region);
  void EndLease(Region& region);
  absl::Time Now() const {
    return options_.clock ? options_.clock() : absl::Now();
  }
  void SweepLoop();

  const Options options_;
  mutable absl::Mutex mu_;
  // By name; each region knows its owner.
  std::map<std::string, std::shared_ptr<Region>> regions_ ABSL_GUARDED_BY(mu_);
  int64_t registered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t idle_released_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;
};

// "system" or "cuda" (errors, logs, metrics labels).
absl::string_view RegionKindName(RegionKind kind);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_SHARED_MEMORY_REGION_REGISTRY_H_
