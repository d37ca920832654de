#include "client/heap_retention.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace detlogp::client {
namespace {

int64_t MinorPageFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

constexpr size_t kBlockBytes = 64 << 10;  // gRPC's receive slice size
constexpr int kBlocks = 512;              // 32 MiB: a 1536-row chunk
constexpr int64_t kPages = int64_t{kBlocks} * kBlockBytes / 4096;

// Page faults of receiving one message as gRPC does: 64 KiB blocks
// allocated and filled in order, then all freed.
int64_t FaultsOfOneMessage() {
  std::vector<void*> blocks(kBlocks);
  const int64_t before = MinorPageFaults();
  for (void*& block : blocks) {
    block = std::malloc(kBlockBytes);
    std::memset(block, 1, kBlockBytes);
  }
  const int64_t faults = MinorPageFaults() - before;
  // Read back, so that the compiler keeps the allocations and the writes.
  volatile unsigned char sink = 0;
  for (void* block : blocks)
    sink = sink + static_cast<unsigned char*>(block)[kBlockBytes - 1];
  for (void* block : blocks) std::free(block);
  return faults;
}

TEST(RetainFreedHeapMemoryTest, RejectsWhatMallocCannotTake) {
  EXPECT_EQ(RetainFreedHeapMemory(-1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RetainFreedHeapMemory(int64_t{1} << 31).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(RetainFreedHeapMemory(0).ok());
}

// With glibc's own threshold (128 KiB) every message lands on fresh pages;
// retaining more than a message reuses the first one's pages.
TEST(RetainFreedHeapMemoryTest, ASecondMessageReusesTheFirstOnesPages) {
  ASSERT_TRUE(RetainFreedHeapMemory(128 << 10).ok());
  FaultsOfOneMessage();
  EXPECT_GT(FaultsOfOneMessage(), kPages / 2)
      << "glibc's default no longer trims?";

  ASSERT_TRUE(RetainFreedHeapMemory(int64_t{256} << 20).ok());
  FaultsOfOneMessage();
  EXPECT_LT(FaultsOfOneMessage(), kPages / 16);
}

TEST(LimitMallocArenasTest, RejectsNegativeCounts) {
  EXPECT_EQ(LimitMallocArenas(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(LimitMallocArenas(0).ok());
}

// With one arena a new thread allocates from the main heap, below the
// program break, not from a mapped heap of its own (which lies above it).
// First in this binary to start a thread: glibc fixes its arena limit at
// the first thread that needs an arena.
TEST(LimitMallocArenasTest, ANewThreadAllocatesFromTheMainHeap) {
  ASSERT_TRUE(LimitMallocArenas(1).ok());
  void* block = nullptr;
  std::thread reader([&block] {
    block = std::malloc(kBlockBytes);
    std::memset(block, 1, kBlockBytes);
  });
  reader.join();
  EXPECT_LT(reinterpret_cast<uintptr_t>(block),
            reinterpret_cast<uintptr_t>(sbrk(0)));
  std::free(block);
}

TEST(TunablesWithMallocHugePagesTest, AppendsToWhatIsSet) {
  EXPECT_EQ(TunablesWithMallocHugePages(nullptr), "glibc.malloc.hugetlb=1");
  EXPECT_EQ(TunablesWithMallocHugePages(""), "glibc.malloc.hugetlb=1");
  EXPECT_EQ(TunablesWithMallocHugePages("glibc.malloc.arena_max=2"),
            "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1");
  EXPECT_EQ(TunablesWithMallocHugePages("glibc.malloc.hugetlbx=1"),
            "glibc.malloc.hugetlbx=1:glibc.malloc.hugetlb=1");
}

TEST(TunablesWithMallocHugePagesTest, LeavesAnExplicitChoice) {
  EXPECT_EQ(TunablesWithMallocHugePages("glibc.malloc.hugetlb=0"),
            std::nullopt);
  EXPECT_EQ(TunablesWithMallocHugePages(
                "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
            std::nullopt);
}

TEST(MallocHugePagesTunableTest, ReadsTheValue) {
  EXPECT_EQ(MallocHugePagesTunable(nullptr), std::nullopt);
  EXPECT_EQ(MallocHugePagesTunable(""), std::nullopt);
  EXPECT_EQ(MallocHugePagesTunable("glibc.malloc.hugetlbx=1"), std::nullopt);
  EXPECT_EQ(MallocHugePagesTunable("glibc.malloc.hugetlb=1"), "1");
  EXPECT_EQ(
      MallocHugePagesTunable("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"),
      "0");
}

}  // namespace
}  // namespace detlogp::client
