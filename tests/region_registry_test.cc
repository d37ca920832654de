// SharedMemoryRegistry on its own: real POSIX shared memory, a fake clock,
// and recording hooks in place of the CUDA backend's.
#include "server/shared_memory/region_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/shared_memory/mapped_reads.h"

namespace detlogp::server {
namespace {

// A POSIX shared-memory object of `bytes` bytes filled with a byte pattern,
// unlinked when the test ends.
class ShmObject {
 public:
  explicit ShmObject(int64_t bytes) {
    static std::atomic<int> counter{0};
    key_ = absl::StrCat("/detlogp_registry_test_", getpid(), "_", counter++);
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << key_;
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    void* data =
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    EXPECT_NE(data, MAP_FAILED);
    for (int64_t i = 0; i < bytes; ++i) {
      static_cast<char*>(data)[i] = static_cast<char>(i * 7 + 1);
    }
    munmap(data, bytes);
  }
  ~ShmObject() { shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }

 private:
  std::string key_;
};

// A registry with a 1 MiB bound, a 10 s idle release swept by the test on
// a clock it moves, and hooks that count pinning.
struct Fixture {
  Fixture() {
    SharedMemoryRegistry::Options options;
    options.clock = [this] { return now; };
    options.idle_release = absl::Seconds(10);
    options.sweep_interval = absl::Hours(1);
    options.max_bytes = int64_t{1} << 20;
    options.pin_host = [this](void*, int64_t bytes) {
      pinned_bytes += bytes;
      return true;
    };
    options.unpin_host = [this](void*) { ++unpinned; };
    registry = *SharedMemoryRegistry::Create(options);
  }
  absl::Time now = absl::FromUnixSeconds(1000);
  int64_t pinned_bytes = 0;
  int unpinned = 0;
  std::unique_ptr<SharedMemoryRegistry> registry;
};

TEST(RegionRegistryTest, LeaseReadsTheObjectsBytesAtTheRegionsOffset) {
  ShmObject object(10000);
  Fixture f;
  // Offset 5000 is not page-aligned: the mapping starts at the page below.
  ASSERT_TRUE(
      f.registry->RegisterSystem("", "rows", object.key(), 5000, 4000).ok());
  EXPECT_GE(f.pinned_bytes, 4000);
  auto lease =
      f.registry->Acquire("", "rows", 100, 200, "hidden.shared_memory");
  ASSERT_TRUE(lease.ok()) << lease.status();
  for (int i = 0; i < 200; ++i) {
    ASSERT_EQ((*lease)->data()[i], static_cast<char>((5100 + i) * 7 + 1)) << i;
  }
  EXPECT_EQ((*lease)->location().kind, HiddenLocation::Kind::kPinnedHost);
  auto listed = f.registry->List("", RegionKind::kSystem, "");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].use.requests_in_flight, 1);
  EXPECT_EQ((*listed)[0].use.bytes_read, 200);
  lease->reset();
  listed = f.registry->List("", RegionKind::kSystem, "rows");
  EXPECT_EQ((*listed)[0].use.requests_in_flight, 0);
  EXPECT_EQ((*listed)[0].use.requests, 1);
}

TEST(RegionRegistryTest, BadRegistrationsNameTheirField) {
  ShmObject object(4096);
  Fixture f;
  struct Case {
    std::string name, key;
    int64_t offset, byte_size;
    absl::StatusCode code;
    std::string field;
  };
  for (const Case& c : std::vector<Case>{
           {"", object.key(), 0, 16, absl::StatusCode::kInvalidArgument,
            "name:"},
           {"a/b", object.key(), 0, 16, absl::StatusCode::kInvalidArgument,
            "name:"},
           {std::string(129, 'x'), object.key(), 0, 16,
            absl::StatusCode::kInvalidArgument, "name:"},
           {"r", "no_slash", 0, 16, absl::StatusCode::kInvalidArgument, "key:"},
           {"r", "/a/b", 0, 16, absl::StatusCode::kInvalidArgument, "key:"},
           {"r", "/detlogp_registry_test_absent", 0, 16,
            absl::StatusCode::kNotFound, "key:"},
           {"r", object.key(), -1, 16, absl::StatusCode::kInvalidArgument,
            "offset:"},
           {"r", object.key(), 0, 0, absl::StatusCode::kInvalidArgument,
            "byte_size:"},
           {"r", object.key(), 4000, 97, absl::StatusCode::kInvalidArgument,
            "byte_size:"},
           {"r", object.key(), 5000, 1, absl::StatusCode::kInvalidArgument,
            "byte_size:"},
       }) {
    const absl::Status s =
        f.registry->RegisterSystem("", c.name, c.key, c.offset, c.byte_size);
    EXPECT_EQ(s.code(), c.code) << c.name << " " << c.key << ": " << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), c.field)) << s;
  }
  EXPECT_EQ(f.registry->totals().system_regions, 0);
  ASSERT_TRUE(f.registry->RegisterSystem("", "r", object.key(), 0, 4096).ok());
  const absl::Status again =
      f.registry->RegisterSystem("", "r", object.key(), 0, 16);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
}

TEST(RegionRegistryTest, BadReferencesNameTheirField) {
  ShmObject object(4096);
  Fixture f;
  ASSERT_TRUE(f.registry->RegisterSystem("a", "r", object.key(), 0, 1000).ok());
  struct Case {
    std::string owner, region;
    int64_t offset, byte_size;
    absl::StatusCode code;
    std::string field;
  };
  for (const Case& c : std::vector<Case>{
           {"a", "absent", 0, 1, absl::StatusCode::kNotFound, "t.region:"},
           {"b", "r", 0, 1, absl::StatusCode::kNotFound, "t.region:"},
           {"", "r", 0, 1, absl::StatusCode::kNotFound, "t.region:"},
           {"a", "r", -1, 1, absl::StatusCode::kInvalidArgument, "t.offset:"},
           {"a", "r", 1001, 0, absl::StatusCode::kInvalidArgument, "t.offset:"},
           {"a", "r", 999, 2, absl::StatusCode::kInvalidArgument,
            "t.byte_size:"},
           {"a", "r", 0, -1, absl::StatusCode::kInvalidArgument,
            "t.byte_size:"},
       }) {
    auto lease =
        f.registry->Acquire(c.owner, c.region, c.offset, c.byte_size, "t");
    ASSERT_FALSE(lease.ok()) << c.owner << " " << c.region;
    EXPECT_EQ(lease.status().code(), c.code) << lease.status();
    EXPECT_TRUE(absl::StartsWith(lease.status().message(), c.field))
        << lease.status();
  }
  EXPECT_TRUE(f.registry->Acquire("a", "r", 1000, 0, "t").ok());
  EXPECT_TRUE(f.registry->Acquire("a", "r", 0, 1000, "t").ok());
}

TEST(RegionRegistryTest, OwnersSeeAndReleaseOnlyTheirRegions) {
  ShmObject object(4096);
  Fixture f;
  ASSERT_TRUE(f.registry->RegisterSystem("a", "ra", object.key(), 0, 10).ok());
  ASSERT_TRUE(f.registry->RegisterSystem("b", "rb", object.key(), 0, 10).ok());
  EXPECT_EQ(f.registry->List("a", RegionKind::kSystem, "")->size(), 1u);
  EXPECT_EQ(f.registry->List("a", RegionKind::kSystem, "rb").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(f.registry->Unregister("a", RegionKind::kSystem, "rb").code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(f.registry->Unregister("a", RegionKind::kSystem, "").ok());
  EXPECT_EQ(f.registry->totals().system_regions, 1);
  EXPECT_EQ(f.registry->List("b", RegionKind::kSystem, "")->size(), 1u);
  // A kind's unregister-all leaves the other kind alone.
  ASSERT_TRUE(f.registry->Unregister("b", RegionKind::kCuda, "").ok());
  EXPECT_EQ(f.registry->totals().system_regions, 1);
}

TEST(RegionRegistryTest, TheByteBoundCountsEveryOwner) {
  ShmObject object(1 << 20);
  Fixture f;  // 1 MiB bound
  ASSERT_TRUE(
      f.registry->RegisterSystem("a", "r1", object.key(), 0, 600 << 10).ok());
  const absl::Status over =
      f.registry->RegisterSystem("b", "r2", object.key(), 0, 500 << 10);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_TRUE(absl::StrContains(over.message(), "--max_shared_memory_bytes"));
  ASSERT_TRUE(
      f.registry->RegisterSystem("b", "r2", object.key(), 0, 424 << 10).ok());
  EXPECT_EQ(f.registry->totals().system_bytes, 1 << 20);
  ASSERT_TRUE(f.registry->Unregister("a", RegionKind::kSystem, "r1").ok());
  EXPECT_TRUE(
      f.registry->RegisterSystem("b", "r3", object.key(), 0, 600 << 10).ok());
}

TEST(RegionRegistryTest, ARegionInUseCannotBeUnregisteredNorSwept) {
  ShmObject object(4096);
  Fixture f;
  ASSERT_TRUE(f.registry->RegisterSystem("", "r1", object.key(), 0, 64).ok());
  ASSERT_TRUE(f.registry->RegisterSystem("", "r2", object.key(), 0, 64).ok());
  auto lease = f.registry->Acquire("", "r1", 0, 64, "t");
  ASSERT_TRUE(lease.ok());
  const absl::Status busy =
      f.registry->Unregister("", RegionKind::kSystem, "r1");
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy;
  EXPECT_TRUE(absl::StartsWith(busy.message(), "name:"));
  // All or none: r2 stays too.
  EXPECT_EQ(f.registry->Unregister("", RegionKind::kSystem, "").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.registry->totals().system_regions, 2);
  // Idle for longer than idle_release, but in use: only r2 is released.
  f.now += absl::Seconds(11);
  EXPECT_EQ(f.registry->ReleaseIdle(), 1);
  EXPECT_EQ(f.registry->totals().system_regions, 1);
  EXPECT_EQ(f.unpinned, 1);
  // The bytes are still readable while the lease lives.
  EXPECT_EQ((*lease)->data()[3], static_cast<char>(3 * 7 + 1));
  lease->reset();
  ASSERT_TRUE(f.registry->Unregister("", RegionKind::kSystem, "r1").ok());
  EXPECT_EQ(f.registry->totals().system_regions, 0);
  EXPECT_EQ(f.unpinned, 2);
}

TEST(RegionRegistryTest, UseKeepsARegionFromTheIdleSweep) {
  ShmObject object(4096);
  Fixture f;
  ASSERT_TRUE(f.registry->RegisterSystem("", "r", object.key(), 0, 64).ok());
  f.now += absl::Seconds(9);
  EXPECT_TRUE(f.registry->Acquire("", "r", 0, 8, "t").ok());  // ends at once
  f.now += absl::Seconds(9);
  EXPECT_EQ(f.registry->ReleaseIdle(), 0);
  f.now += absl::Seconds(1);
  EXPECT_EQ(f.registry->ReleaseIdle(), 1);
  EXPECT_EQ(f.registry->totals().idle_released, 1);
  EXPECT_EQ(f.registry->Acquire("", "r", 0, 8, "t").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(RegionRegistryTest, CudaRegionsGoThroughTheHooks) {
  Fixture refused;
  EXPECT_EQ(refused.registry->RegisterCuda("", "g", std::string(64, 'h'), 0, 64)
                .code(),
            absl::StatusCode::kFailedPrecondition);

  SharedMemoryRegistry::Options options;
  static char device_memory[256];
  int closed = 0;
  options.open_ipc = [](const std::string& handle, int device,
                        int64_t bytes) -> absl::StatusOr<void*> {
    if (device != 1) {
      return absl::InvalidArgumentError("device_id: not used by the server");
    }
    if (bytes > 256) return absl::InvalidArgumentError("byte_size: too big");
    return device_memory;
  };
  options.close_ipc = [&closed](void* data, int device) {
    EXPECT_EQ(data, device_memory);
    EXPECT_EQ(device, 1);
    ++closed;
  };
  options.max_bytes = 1 << 20;
  auto registry = *SharedMemoryRegistry::Create(options);
  EXPECT_EQ(registry->RegisterCuda("", "g", "h", 0, 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry->RegisterCuda("", "g", "h", 1, 257).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry->RegisterCuda("", "g", "", 1, 64).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry->RegisterCuda("", "g", "h", 1, 256).ok());
  auto lease = registry->Acquire("", "g", 128, 128, "t");
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ((*lease)->data(), device_memory + 128);
  EXPECT_EQ((*lease)->location().kind, HiddenLocation::Kind::kDevice);
  EXPECT_EQ((*lease)->location().device, 1);
  // System and CUDA regions share one namespace.
  EXPECT_EQ(registry->RegisterCuda("", "g", "h", 1, 8).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry->Unregister("", RegionKind::kSystem, "g").code(),
            absl::StatusCode::kNotFound);
  lease->reset();
  ASSERT_TRUE(registry->Unregister("", RegionKind::kCuda, "g").ok());
  EXPECT_EQ(closed, 1);
}

int OpenDescriptors() {
  return static_cast<int>(
      std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                    std::filesystem::directory_iterator()));
}

// The owner of a system region may truncate its object at any time: a
// request after that is refused at Acquire, and a lease taken before reads
// through the guard and gets a status instead of a SIGBUS.
TEST(RegionRegistryTest, AnObjectTruncatedByItsOwnerIsRefusedNamingTheField) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  ShmObject object(3 * page);
  Fixture f;
  const int descriptors = OpenDescriptors();
  ASSERT_TRUE(
      f.registry->RegisterSystem("", "rows", object.key(), page, 2 * page)
          .ok());
  auto before = f.registry->Acquire("", "rows", 0, 2 * page, "t");
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_TRUE((*before)->location().owner_may_truncate);
  EXPECT_EQ((*before)->location().region, "rows");
  std::string copy(2 * page, '\0');
  ASSERT_TRUE(CopyFromMapping(copy.data(), (*before)->data(), 2 * page).ok());

  const int fd = shm_open(object.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 2 * page), 0);  // the region's second page goes
  close(fd);
  EXPECT_EQ(CopyFromMapping(copy.data(), (*before)->data(), 2 * page).code(),
            absl::StatusCode::kFailedPrecondition);
  // Even a request for the bytes still there: the region as registered is
  // gone.
  auto after = f.registry->Acquire("", "rows", 0, 16, "hidden.shared_memory");
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(after.status().message(),
                               "hidden.shared_memory: region \"rows\" shrank"))
      << after.status();
  auto listed = f.registry->List("", RegionKind::kSystem, "rows");
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ((*listed)[0].use.requests, 1);  // the refused one is not counted
  EXPECT_EQ((*listed)[0].use.requests_in_flight, 1);
  before->reset();
  ASSERT_TRUE(f.registry->Unregister("", RegionKind::kSystem, "rows").ok());
  // The descriptor kept to watch the object's size is closed with it.
  EXPECT_EQ(OpenDescriptors(), descriptors);
}

}  // namespace
}  // namespace detlogp::server
