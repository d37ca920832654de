// LogpClient's own shared-memory regions: placing them with the replicas,
// making and releasing them, and scoring calls through them (system regions
// for host rows, CUDA regions for device rows).
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "client/logp_client.h"
#include "client/request_rows.h"
#include "proto/dtype_bytes.h"
#include "proto/status_details.h"
#include "spdlog/spdlog.h"

namespace detlogp::client {
namespace {

// Registration refusals that mean "not here": the client sends bytes.
bool IsRefusal(absl::StatusCode code) {
  return code == absl::StatusCode::kFailedPrecondition ||
         code == absl::StatusCode::kPermissionDenied ||
         code == absl::StatusCode::kUnimplemented ||
         code == absl::StatusCode::kNotFound ||
         code == absl::StatusCode::kResourceExhausted;
}

// The same for a CUDA region, whose handle or device the server may also
// not be able to open (another host's GPU, a GPU it does not compute on):
// INVALID_ARGUMENT naming raw_handle or device_id.
bool IsCudaRefusal(absl::StatusCode code) {
  return IsRefusal(code) || code == absl::StatusCode::kInvalidArgument;
}

// A request named a region the server no longer holds (released after
// --shared_memory_idle_s unused, or the server restarted).
// Decided from the details (reason REGION_GONE naming the region), never
// the message.
bool IsRegionGone(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kNotFound) return false;
  const v1::ErrorDetails details = v1::DetailsOf(status);
  return details.reason == v1::kReasonRegionGone &&
         std::find(details.fields.begin(), details.fields.end(),
                   "hidden.shared_memory.region") != details.fields.end();
}

// Room to grow: calls of about the same size reuse a region.
int64_t RegionBytesFor(int64_t bytes) {
  constexpr int64_t kGranule = int64_t{2} << 20;
  return (bytes + kGranule - 1) / kGranule * kGranule;
}

// A region name no other region of this process has.
std::string UniqueRegionName(absl::string_view kind) {
  std::random_device random;
  return absl::StrCat("detlogp_", kind, getpid(), "_", random(), random());
}

}  // namespace

LogpClient::ReplicaList LogpClient::PlaceRegion(
    RegionPlaces& places, const RegionKind& kind, const ReplicaList& replicas,
    bool can_register, bool* missing, absl::Status* refusal,
    absl::Status* failure) {
  ReplicaList holding;
  *missing = false;
  const absl::Time now = absl::Now();
  for (const std::shared_ptr<Replica>& replica : replicas) {
    if (places.registered.count(replica->id) != 0) {
      holding.push_back(replica);
      continue;
    }
    if (places.refused.count(replica->id) != 0) continue;
    if ((*replica).*kind.refuses) {
      places.refused.insert(replica->id);
      *refusal = absl::FailedPreconditionError(absl::StrCat(
          replica->target, " refused a region of this kind before"));
      continue;
    }
    if (!replica->health.Usable(now)) continue;  // asked once it is back
    if (!can_register) {
      *missing = true;
      continue;
    }
    const absl::Status status = kind.register_on(replica->regions);
    if (status.ok()) {
      replica->health.Answered();
      places.registered.emplace(replica->id, replica);
      holding.push_back(replica);
    } else if (kind.is_refusal(status.code())) {
      // Another host (or the server's bound): its requests carry bytes.
      replica->health.Answered();
      places.refused.insert(replica->id);
      // A full bound (RESOURCE_EXHAUSTED) may take a region later.
      if (status.code() != absl::StatusCode::kResourceExhausted &&
          !((*replica).*kind.refuses).exchange(true)) {
        spdlog::info(
            "{} refused a shared-memory region; calls through "
            "regions go to the replicas that accept them: {}",
            replica->target, status.ToString());
      }
      *refusal = status;
    } else if (status.code() == absl::StatusCode::kUnavailable) {
      replica->health.Failed(now);  // asked again once it is back
    } else {
      *failure = status;
    }
  }
  return holding;
}

void LogpClient::UnplaceRegion(const RegionPlaces& places,
                               const RegionKind& kind) {
  // Best effort: a server releases an idle region by itself.
  for (const auto& [id, weak] : places.registered) {
    std::shared_ptr<Replica> replica = weak.lock();
    if (replica == nullptr || replica->retired || !replica->health.up()) {
      continue;
    }
    kind.unregister_on(replica->regions);
  }
}

LogpClient::RegionKind LogpClient::SystemKind(const SystemRegion& region) {
  RegionKind kind;
  const std::string name = region.name;
  const std::string key = region.memory->key();
  const int64_t size = region.memory->bytes();
  kind.register_on = [name, key, size](RegionApi& api) {
    return api.RegisterSystem(name, key, 0, size);
  };
  kind.unregister_on = [name](RegionApi& api) {
    api.UnregisterSystem(name, kReleaseTimeout).IgnoreError();
  };
  kind.refuses = &Replica::refuses_system;
  kind.is_refusal = IsRefusal;
  return kind;
}

absl::StatusOr<std::unique_ptr<LogpClient::SystemRegion>>
LogpClient::MakeSystemRegion(int64_t bytes, const ReplicaList& replicas) {
  const int64_t size = RegionBytesFor(bytes);
  auto memory = SystemSharedMemory::Create(size);
  if (!memory.ok()) return memory.status();
  auto region = std::make_unique<SystemRegion>();
  region->memory = *std::move(memory);
  region->name = UniqueRegionName("");
  bool missing = false;
  absl::Status refusal, failure;
  const ReplicaList holding =
      PlaceRegion(region->places, SystemKind(*region), replicas,
                  /*can_register=*/true, &missing, &refusal, &failure);
  if (holding.empty()) {
    if (!failure.ok()) return failure;
    if (!refusal.ok()) return refusal;
    return absl::UnavailableError(
        "system_shared_memory: no replica answered the region's "
        "registration");
  }
  // The servers hold their own mappings: the name is no longer needed, and
  // a client killed now leaves nothing in /dev/shm.
  region->memory->Unlink();
  return region;
}

void LogpClient::ReleaseSystemRegion(const SystemRegion& region) {
  UnplaceRegion(region.places, SystemKind(region));
}

int LogpClient::ReleaseIdleSystemRegions() {
  std::vector<std::unique_ptr<SystemRegion>> idle = system_regions_.TakeIdle();
  for (const auto& region : idle) ReleaseSystemRegion(*region);
  return static_cast<int>(idle.size());
}

absl::StatusOr<std::optional<ScoreResult>> LogpClient::ScoreThroughSystemRegion(
    const detlogp::v1::LogProbRequest& request, absl::string_view data,
    absl::Time deadline) {
  if (data.empty() || request.hidden().has_shared_memory()) {
    return std::nullopt;
  }
  const int64_t bytes = static_cast<int64_t>(data.size());
  const ReplicaList replicas = Replicas();
  RegionMaker<SystemRegion> maker;
  maker.make = [this, &replicas](int64_t size) {
    return MakeSystemRegion(size, replicas);
  };
  maker.release = [this](const SystemRegion& region) {
    ReleaseSystemRegion(region);
  };
  maker.is_refusal = [](const absl::Status& status) {
    return IsRefusal(status.code());
  };
  bool registered_again = false;
  while (true) {
    {
      absl::MutexLock lock(&shared_memory_mu_);
      if (!shared_memory_refusal_.empty()) return std::nullopt;
    }
    absl::Status refusal;
    auto leased = LeaseRegion(system_regions_, bytes, deadline, maker,
                              "system_shared_memory", &refusal);
    if (!leased.ok()) return leased.status();
    if (!leased->has_value()) {
      // Every replica refused: regions are off for the client.
      const std::string why = refusal.ToString();
      spdlog::warn(
          "system shared-memory region refused at registration; rows go "
          "in the messages from now on: {}",
          why);
      absl::MutexLock lock(&shared_memory_mu_);
      shared_memory_refusal_ = why;
      return std::nullopt;
    }
    RegionPool<SystemRegion>::Lease lease = **std::move(leased);
    bool missing = false;
    absl::Status place_refusal, failure;
    ReplicaList holding =
        PlaceRegion(lease.get()->places, SystemKind(*lease.get()), replicas,
                    /*can_register=*/false, &missing, &place_refusal, &failure);
    if (missing || holding.empty()) {
      // A replica that may take it joined (or came back) after the region
      // was made: a new one is registered with every replica.
      ReleaseSystemRegion(*lease.Take());
      auto made = MakeSystemRegion(bytes, replicas);
      if (!made.ok()) {
        if (IsRefusal(made.status().code())) return std::nullopt;
        return made.status();
      }
      lease.Set(*std::move(made));
      holding = PlaceRegion(lease.get()->places, SystemKind(*lease.get()),
                            replicas, /*can_register=*/false, &missing,
                            &place_refusal, &failure);
    }
    detlogp::v1::LogProbRequest by_reference = WithoutHiddenBytes(request);
    detlogp::v1::SharedMemoryRef* ref =
        by_reference.mutable_hidden()->mutable_shared_memory();
    ref->set_region(lease.get()->name);
    ref->set_offset(0);
    ref->set_byte_size(bytes);
    const RegionWrite write{static_cast<char*>(lease.get()->memory->data()),
                            data};
    absl::StatusOr<ScoreResult> result = ScoreCut(
        by_reference, {}, /*rows_beside=*/false, deadline, &holding, &write);
    if (!registered_again && IsRegionGone(result.status())) {
      // A server's copy is gone (it restarted): drop ours, register a new
      // one.
      ReleaseSystemRegion(*lease.Take());
      registered_again = true;
      continue;
    }
    if (!result.ok()) return result.status();
    result->path = "system_shm";
    result->used_shared_memory = true;
    return std::optional<ScoreResult>(*std::move(result));
  }
}

RegionPool<LogpClient::CudaRegion>& LogpClient::CudaPool(int device) {
  absl::MutexLock lock(&cuda_mu_);
  std::unique_ptr<RegionPool<CudaRegion>>& pool = cuda_pools_[device];
  if (pool == nullptr) {
    pool = std::make_unique<RegionPool<CudaRegion>>(
        options_.cuda_shared_memory_regions);
  }
  return *pool;
}

std::string LogpClient::CudaRefusal() const {
  absl::MutexLock lock(&cuda_mu_);
  return cuda_refusal_;
}

absl::StatusOr<std::optional<ScoreResult>> LogpClient::ScoreThroughCudaRegion(
    const CudaRuntime& cuda, const DeviceRows& rows,
    const detlogp::v1::LogProbRequest& request, absl::Time deadline) {
  const int64_t bytes = rows.rows * rows.hidden_size *
                        detlogp::v1::DTypeBytes(detlogp::v1::DTYPE_BFLOAT16);
  RegionPool<CudaRegion>& pool = CudaPool(rows.device);
  const ReplicaList replicas = Replicas();
  RegionMaker<CudaRegion> maker;
  maker.make = [this, &cuda, &replicas, device = rows.device](int64_t size) {
    return MakeCudaRegion(cuda, device, size, replicas);
  };
  maker.release = [this](const CudaRegion& region) {
    ReleaseCudaRegion(region);
  };
  maker.is_refusal = [](const absl::Status& status) {
    return IsCudaRefusal(status.code());
  };
  bool registered_again = false;
  while (true) {
    if (!CudaRefusal().empty()) return std::nullopt;
    absl::Status refusal;
    auto leased = LeaseRegion(
        pool, bytes, deadline, maker,
        absl::StrCat("cuda_shared_memory (cuda:", rows.device, ")"), &refusal);
    if (!leased.ok()) return leased.status();
    if (!leased->has_value()) {
      // The refusal turns CUDA regions off for the client.
      const std::string why = refusal.ToString();
      spdlog::warn(
          "CUDA shared-memory region refused at registration; rows go "
          "through the host from now on: {}",
          why);
      absl::MutexLock lock(&cuda_mu_);
      cuda_refusal_ = why;
      return std::nullopt;
    }
    RegionPool<CudaRegion>::Lease lease = **std::move(leased);
    // An IPC handle opens anywhere on this host, at any time: replicas
    // that joined since the region was made get it now.
    bool missing = false;
    absl::Status place_refusal, failure;
    ReplicaList holding =
        PlaceRegion(lease.get()->places, CudaKind(*lease.get()), replicas,
                    /*can_register=*/true, &missing, &place_refusal, &failure);
    if (holding.empty()) return std::nullopt;  // none up holds it: the host
    // On the caller's stream, after whatever wrote the rows; done when the
    // request goes.
    if (absl::Status s =
            cuda.Copy(lease.get()->memory->data(), rows.data, bytes,
                      CudaCopy::kDeviceToDevice, rows.device, rows.stream);
        !s.ok()) {
      return s;
    }
    detlogp::v1::LogProbRequest by_reference = request;
    detlogp::v1::SharedMemoryRef* ref =
        by_reference.mutable_hidden()->mutable_shared_memory();
    ref->set_region(lease.get()->name);
    ref->set_offset(0);
    ref->set_byte_size(bytes);
    absl::StatusOr<ScoreResult> result =
        ScoreCut(by_reference, {}, /*rows_beside=*/false, deadline, &holding);
    if (!registered_again && IsRegionGone(result.status())) {
      // A server closed its handle: free the memory, register anew.
      ReleaseCudaRegion(*lease.Take());
      registered_again = true;
      continue;
    }
    if (!result.ok()) return result.status();
    result->path = "cuda_shm";
    result->used_shared_memory = true;
    return std::optional<ScoreResult>(*std::move(result));
  }
}

LogpClient::RegionKind LogpClient::CudaKind(const CudaRegion& region) {
  RegionKind kind;
  const std::string name = region.name;
  const std::string handle = region.handle;
  const int device = region.device;
  const int64_t size = region.memory->bytes();
  kind.register_on = [name, handle, device, size](RegionApi& api) {
    return api.RegisterCuda(name, handle, device, size);
  };
  kind.unregister_on = [name](RegionApi& api) {
    api.UnregisterCuda(name, kReleaseTimeout).IgnoreError();
  };
  kind.refuses = &Replica::refuses_cuda;
  kind.is_refusal = IsCudaRefusal;
  return kind;
}

absl::StatusOr<std::unique_ptr<LogpClient::CudaRegion>>
LogpClient::MakeCudaRegion(const CudaRuntime& cuda, int device, int64_t bytes,
                           const ReplicaList& replicas) {
  const int64_t size = RegionBytesFor(bytes);
  // The region's base is the allocation's, so its IPC handle names it from
  // byte 0.
  auto memory = DeviceMemory::Allocate(&cuda, device, size);
  if (!memory.ok()) return memory.status();
  auto handle = cuda.IpcMemHandle(device, (*memory)->data());
  if (!handle.ok()) return handle.status();
  auto region = std::make_unique<CudaRegion>();
  region->memory = *std::move(memory);
  region->name = UniqueRegionName(absl::StrCat("cuda", device, "_"));
  region->handle = *std::move(handle);
  region->device = device;
  bool missing = false;
  absl::Status refusal, failure;
  const ReplicaList holding =
      PlaceRegion(region->places, CudaKind(*region), replicas,
                  /*can_register=*/true, &missing, &refusal, &failure);
  if (holding.empty()) {
    if (!failure.ok()) return failure;
    if (!refusal.ok()) return refusal;
    return absl::UnavailableError(
        "cuda_shared_memory: no replica answered the region's registration");
  }
  return region;
}

void LogpClient::ReleaseCudaRegion(const CudaRegion& region) {
  UnplaceRegion(region.places, CudaKind(region));
}

}  // namespace detlogp::client
