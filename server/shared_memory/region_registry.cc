#include "server/shared_memory/region_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "server/shared_memory/mapped_reads.h"
#include "spdlog/spdlog.h"
#include "proto/status_details.h"

namespace detlogp::server {

// One registered region. Its memory is released when the last reference
// goes: the registry's (until unregistered or idle) and each Lease's.
class SharedMemoryRegistry::Region {
 public:
  struct Release {
    void* mapping = nullptr;  // system: munmap'ed
    size_t mapping_bytes = 0;
    // system: the object, kept open to see whether its owner truncated it
    // (closed).
    int object_fd = -1;
    bool pinned = false;
    std::function<void(void*)> unpin_host;
    void* device_data = nullptr;  // CUDA: closed
    int device = -1;
    std::function<void(void*, int)> close_ipc;
  };

  Region(std::string owner, RegionStatus status, const char* data,
         Release release)
      : owner_(std::move(owner)),
        status_(std::move(status)),
        data_(data),
        release_(std::move(release)) {}

  ~Region() {
    if (release_.mapping != nullptr) {
      if (release_.pinned && release_.unpin_host) {
        release_.unpin_host(release_.mapping);
      }
      munmap(release_.mapping, release_.mapping_bytes);
    }
    if (release_.object_fd >= 0) close(release_.object_fd);
    if (release_.device_data != nullptr && release_.close_ipc) {
      release_.close_ipc(release_.device_data, release_.device);
    }
  }

  const std::string& owner() const { return owner_; }
  // Mutable use counters, guarded by the registry's mutex.
  RegionStatus& status() { return status_; }
  const RegionStatus& status() const { return status_; }
  const char* data() const { return data_; }

  // Whether a system region's object still holds every registered byte:
  // its owner may have truncated it since (a CUDA region: always).
  bool ObjectHoldsRegion() const {
    if (release_.object_fd < 0) return true;
    struct stat info;
    // Cannot tell: the guarded reads still catch a truncation.
    if (fstat(release_.object_fd, &info) != 0) return true;
    return info.st_size >= status_.offset + status_.byte_size;
  }

 private:
  const std::string owner_;
  RegionStatus status_;
  const char* const data_;
  const Release release_;
};

namespace {

constexpr size_t kMaxNameLength = 128;

absl::Status CheckName(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameLength) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "name",
        absl::StrCat("\"", name.substr(0, kMaxNameLength), "\" must be 1-",
                     kMaxNameLength, " characters"));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' &&
        c != '.' && c != '-') {
      return v1::FieldError(
          absl::StatusCode::kInvalidArgument, "name",
          absl::StrCat("\"", name, "\" may hold only [A-Za-z0-9_.-]"));
    }
  }
  return absl::OkStatus();
}

// shm_open's rule: one leading '/', no other, at most NAME_MAX.
absl::Status CheckKey(const std::string& key) {
  if (key.size() < 2 || key.size() > 255 || key[0] != '/' ||
      key.find('/', 1) != std::string::npos ||
      key.find('\0') != std::string::npos) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "key",
                          absl::StrCat("\"", key.substr(0, 64),
                                       "\" is not a shared-memory object name "
                                       "(\"/name\", one slash, at most "
                                       "255 characters)"));
  }
  return absl::OkStatus();
}

bool IdleFor(const SharedMemoryRegistry::Use& use, absl::Time now,
             absl::Duration idle) {
  return idle > absl::ZeroDuration() && use.requests_in_flight == 0 &&
         now - use.last_use >= idle;
}

}  // namespace

absl::string_view RegionKindName(RegionKind kind) {
  return kind == RegionKind::kSystem ? "system" : "cuda";
}

SharedMemoryRegistry::Lease::~Lease() { registry_->EndLease(*region_); }

absl::StatusOr<std::unique_ptr<SharedMemoryRegistry>>
SharedMemoryRegistry::Create(Options options) {
  if (options.max_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_shared_memory_bytes must be positive, got ", options.max_bytes));
  }
  if (options.idle_release < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--shared_memory_idle_s must be >= 0");
  }
  if (options.sweep_interval <= absl::ZeroDuration()) {
    options.sweep_interval = std::clamp(
        options.idle_release / 4, absl::Milliseconds(10), absl::Seconds(5));
  }
  return absl::WrapUnique(new SharedMemoryRegistry(std::move(options)));
}

SharedMemoryRegistry::SharedMemoryRegistry(Options options)
    : options_(std::move(options)) {
  if (options_.idle_release > absl::ZeroDuration()) {
    sweeper_ = std::thread([this] { SweepLoop(); });
  }
}

SharedMemoryRegistry::~SharedMemoryRegistry() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
}

void SharedMemoryRegistry::SweepLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.sweep_interval);
    if (stopping_) break;
    mu_.Unlock();
    ReleaseIdle();
    mu_.Lock();
  }
}

int SharedMemoryRegistry::ReleaseIdle() {
  // Released outside the lock: unpinning and unmapping take time.
  std::vector<std::shared_ptr<Region>> released;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = Now();
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (!IdleFor(it->second->status().use, now, options_.idle_release)) {
        ++it;
        continue;
      }
      registered_bytes_ -= it->second->status().byte_size;
      released.push_back(std::move(it->second));
      it = regions_.erase(it);
    }
    idle_released_ += static_cast<int64_t>(released.size());
  }
  for (const auto& region : released) {
    spdlog::info("shared memory: {} region {} unused for {}; released",
                 std::string(RegionKindName(region->status().kind)),
                 region->status().name,
                 absl::FormatDuration(options_.idle_release));
  }
  return static_cast<int>(released.size());
}

absl::Status SharedMemoryRegistry::CheckNewRegion(const std::string& name,
                                                  int64_t byte_size) const {
  if (regions_.count(name) != 0) {
    return v1::FieldError(
        absl::StatusCode::kAlreadyExists, "name",
        absl::StrCat("a region \"", name,
                     "\" is registered; unregister it first"));
  }
  if (byte_size > options_.max_bytes - registered_bytes_) {
    return v1::FieldError(
        absl::StatusCode::kResourceExhausted, "byte_size",
        absl::StrCat(byte_size, " bytes with ", registered_bytes_,
                     " registered exceeds the server's bound of ",
                     options_.max_bytes, " bytes (--max_shared_memory_bytes)"),
        v1::kReasonRegionRefused,
        {{"limit", absl::StrCat(options_.max_bytes)},
         {"requested", absl::StrCat(byte_size)}});
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Insert(std::shared_ptr<Region> region) {
  absl::MutexLock lock(&mu_);
  const RegionStatus& status = region->status();
  // Checked again: another call may have registered meanwhile (mapping
  // happens outside the lock). On refusal the region is released at once.
  if (absl::Status s = CheckNewRegion(status.name, status.byte_size); !s.ok())
    return s;
  registered_bytes_ += status.byte_size;
  regions_.emplace(status.name, std::move(region));
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::RegisterSystem(const std::string& owner,
                                                  const std::string& name,
                                                  const std::string& key,
                                                  int64_t offset,
                                                  int64_t byte_size) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (offset < 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "offset",
                          absl::StrCat(offset, " is negative"));
  }
  if (byte_size <= 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "byte_size",
                          absl::StrCat(byte_size, " must be positive"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckNewRegion(name, byte_size); !s.ok()) return s;
  }
  const int fd = shm_open(key.c_str(), O_RDONLY, 0);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) {
      return v1::FieldError(
          absl::StatusCode::kNotFound, "key",
          absl::StrCat("no shared-memory object \"", key, "\" on this host"));
    }
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "key",
        absl::StrCat("cannot open \"", key, "\": ", std::strerror(error)));
  }
  struct stat info;
  if (fstat(fd, &info) != 0) {
    const int error = errno;
    close(fd);
    return absl::InternalError(
        absl::StrCat("fstat of \"", key, "\": ", std::strerror(error)));
  }
  const int64_t object_bytes = info.st_size;
  if (offset > object_bytes || byte_size > object_bytes - offset) {
    close(fd);
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "byte_size",
        absl::StrCat("offset ", offset, " + byte_size ", byte_size,
                     " exceeds the ", object_bytes, " bytes of \"", key, "\""));
  }
  // mmap's offset must be page-aligned; the region starts inside the page.
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t map_offset = offset - offset % page;
  const size_t map_bytes = static_cast<size_t>(offset - map_offset + byte_size);
  void* mapping =
      mmap(nullptr, map_bytes, PROT_READ, MAP_SHARED, fd, map_offset);
  const int map_error = errno;
  if (mapping == MAP_FAILED) {
    close(fd);
    return v1::FieldError(absl::StatusCode::kResourceExhausted, "key",
                          absl::StrCat("cannot map ", map_bytes, " bytes of \"",
                                       key, "\": ", std::strerror(map_error)));
  }
  Region::Release release;
  release.mapping = mapping;
  release.mapping_bytes = map_bytes;
  // The mapping keeps the object; the descriptor tells its size per request.
  release.object_fd = fd;
  release.pinned = options_.pin_host &&
                   options_.pin_host(mapping, static_cast<int64_t>(map_bytes));
  release.unpin_host = options_.unpin_host;
  RegionStatus status;
  status.name = name;
  status.kind = RegionKind::kSystem;
  status.key = key;
  status.offset = offset;
  status.byte_size = byte_size;
  status.pinned = release.pinned;
  status.use.last_use = Now();
  const bool pinned = release.pinned;
  const char* data = static_cast<const char*>(mapping) + (offset - map_offset);
  auto region = std::make_shared<Region>(owner, std::move(status), data,
                                         std::move(release));
  if (absl::Status s = Insert(std::move(region)); !s.ok()) return s;
  spdlog::info("shared memory: system region {} registered ({} bytes of {}{})",
               name, byte_size, key,
               pinned ? ", pinned for direct copies" : "");
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::RegisterCuda(const std::string& owner,
                                                const std::string& name,
                                                const std::string& raw_handle,
                                                int64_t device_id,
                                                int64_t byte_size) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (raw_handle.empty()) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "raw_handle",
                          "empty");
  }
  if (device_id < 0 || device_id > 1024) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "device_id",
                          absl::StrCat(device_id, " is not a CUDA device"));
  }
  if (byte_size <= 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "byte_size",
                          absl::StrCat(byte_size, " must be positive"));
  }
  if (!options_.open_ipc) {
    return absl::FailedPreconditionError(
        "CUDA shared memory: this server computes on the CPU");
  }
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckNewRegion(name, byte_size); !s.ok()) return s;
  }
  const int device = static_cast<int>(device_id);
  auto opened = options_.open_ipc(raw_handle, device, byte_size);
  if (!opened.ok()) return opened.status();
  Region::Release release;
  release.device_data = *opened;
  release.device = device;
  release.close_ipc = options_.close_ipc;
  RegionStatus status;
  status.name = name;
  status.kind = RegionKind::kCuda;
  status.device = device;
  status.byte_size = byte_size;
  status.use.last_use = Now();
  auto region = std::make_shared<Region>(owner, std::move(status),
                                         static_cast<const char*>(*opened),
                                         std::move(release));
  if (absl::Status s = Insert(std::move(region)); !s.ok()) return s;
  spdlog::info("shared memory: CUDA region {} registered ({} bytes on cuda:{})",
               name, byte_size, device);
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Unregister(const std::string& owner,
                                              RegionKind kind,
                                              const std::string& name) {
  std::vector<std::shared_ptr<Region>> released;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::map<std::string, std::shared_ptr<Region>>::iterator>
        chosen;
    for (auto it = name.empty() ? regions_.begin() : regions_.find(name);
         it != regions_.end(); ++it) {
      const Region& region = *it->second;
      if (region.owner() == owner && region.status().kind == kind) {
        chosen.push_back(it);
      }
      if (!name.empty()) break;
    }
    if (!name.empty() && chosen.empty()) {
      return v1::FieldError(
          absl::StatusCode::kNotFound, "name",
          absl::StrCat("no ", RegionKindName(kind), " region \"", name, "\""));
    }
    for (const auto& it : chosen) {
      const Use& use = it->second->status().use;
      if (use.requests_in_flight > 0) {
        return v1::FieldError(
            absl::StatusCode::kFailedPrecondition, "name",
            absl::StrCat(
                "region \"", it->first, "\" is read by ",
                use.requests_in_flight,
                " request(s) in flight; unregister it once they are answered"));
      }
    }
    for (const auto& it : chosen) {
      registered_bytes_ -= it->second->status().byte_size;
      released.push_back(std::move(it->second));
      regions_.erase(it);
    }
  }
  for (const auto& region : released) {
    spdlog::info("shared memory: {} region {} unregistered",
                 std::string(RegionKindName(kind)), region->status().name);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SharedMemoryRegistry::RegionStatus>>
SharedMemoryRegistry::List(const std::string& owner, RegionKind kind,
                           const std::string& name) const {
  std::vector<RegionStatus> listed;
  absl::MutexLock lock(&mu_);
  for (const auto& [region_name, region] : regions_) {
    if (region->owner() != owner || region->status().kind != kind) continue;
    if (!name.empty() && region_name != name) continue;
    listed.push_back(region->status());
  }
  if (!name.empty() && listed.empty()) {
    return v1::FieldError(
        absl::StatusCode::kNotFound, "name",
        absl::StrCat("no ", RegionKindName(kind), " region \"", name, "\""));
  }
  return listed;
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegistry::Lease>>
SharedMemoryRegistry::Acquire(const std::string& owner,
                              const std::string& region_name, int64_t offset,
                              int64_t byte_size, absl::string_view field) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region_name);
  // Another owner's region is reported as absent: its name says nothing.
  if (it == regions_.end() || it->second->owner() != owner) {
    return v1::FieldError(
        absl::StatusCode::kNotFound, absl::StrCat(field, ".region"),
        absl::StrCat("no region \"", region_name.substr(0, kMaxNameLength),
                     "\" is registered",
                     owner.empty() ? "" : " with this token"),
        v1::kReasonRegionGone);
  }
  std::shared_ptr<Region> region = it->second;
  RegionStatus& status = region->status();
  if (offset < 0 || offset > status.byte_size) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, absl::StrCat(field, ".offset"),
        absl::StrCat(offset, " is outside region \"", region_name, "\" of ",
                     status.byte_size, " bytes"));
  }
  if (byte_size < 0 || byte_size > status.byte_size - offset) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument,
                          absl::StrCat(field, ".byte_size"),
                          absl::StrCat(byte_size, " bytes from offset ", offset,
                                       " exceed region \"", region_name,
                                       "\" of ", status.byte_size, " bytes"));
  }
  // Refused early when the owner already truncated the object (one fstat);
  // a truncation after this check is caught by the guarded reads.
  if (!region->ObjectHoldsRegion()) {
    return RegionShrankError(field, region_name);
  }
  ++status.use.requests_in_flight;
  ++status.use.requests;
  status.use.bytes_read += byte_size;
  status.use.last_use = Now();
  HiddenLocation location;
  location.region = status.name;
  if (status.kind == RegionKind::kCuda) {
    location.kind = HiddenLocation::Kind::kDevice;
    location.device = status.device;
  } else {
    if (status.pinned) location.kind = HiddenLocation::Kind::kPinnedHost;
    location.owner_may_truncate = true;
  }
  const char* data = region->data() + offset;
  return std::shared_ptr<const Lease>(
      new Lease(this, std::move(region), data, location));
}

void SharedMemoryRegistry::EndLease(Region& region) {
  absl::MutexLock lock(&mu_);
  --region.status().use.requests_in_flight;
  region.status().use.last_use = Now();
}

SharedMemoryRegistry::Totals SharedMemoryRegistry::totals() const {
  Totals totals;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, region] : regions_) {
    const RegionStatus& status = region->status();
    if (status.kind == RegionKind::kSystem) {
      ++totals.system_regions;
      totals.system_bytes += status.byte_size;
    } else {
      ++totals.cuda_regions;
      totals.cuda_bytes += status.byte_size;
    }
  }
  totals.idle_released = idle_released_;
  return totals;
}

}  // namespace detlogp::server
