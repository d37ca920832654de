// The chunk buffers' allocators on the CPU: the heap pool, and the caching
// pool the CUDA backend fills with pinned memory, here with counted
// malloc/free in place of cudaHostAlloc/cudaFreeHost: reuse by size, the
// bound on bytes kept, the heap fallback, buffers outliving the pool, and
// several threads at once.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "server/backends/caching_host_buffer_pool.h"
#include "server/backends/host_buffer_pool.h"

namespace detlogp::server {
namespace {

TEST(HeapHostBufferPoolTest, BuffersAreWritableAndOutliveThePool) {
  std::shared_ptr<HostBufferPool> pool = NewHeapHostBufferPool();
  HostBuffer buffer = pool->Acquire(1000);
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(buffer.bytes(), 1000u);
  pool.reset();
  std::memset(buffer.data(), 0x5a, buffer.bytes());  // still ours (ASan-clean)
  HostBuffer moved = std::move(buffer);
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_EQ(moved.bytes(), 1000u);
}

TEST(HostBufferTest, ReleasesExactlyOnceAcrossMoves) {
  int released = 0;
  char storage[16];
  {
    HostBuffer a(storage, sizeof(storage), [&](char* data, size_t bytes) {
      EXPECT_EQ(data, storage);
      EXPECT_EQ(bytes, sizeof(storage));
      ++released;
    });
    HostBuffer b = std::move(a);
    HostBuffer c;
    c = std::move(b);
    EXPECT_EQ(released, 0);
  }
  EXPECT_EQ(released, 1);
}

TEST(HeapHostBufferPoolTest, CountsEveryBufferAsNew) {
  std::shared_ptr<HostBufferPool> pool = NewHeapHostBufferPool();
  { HostBuffer a = pool->Acquire(10); }
  { HostBuffer b = pool->Acquire(10); }
  const HostBufferPool::Stats stats = pool->stats();
  EXPECT_EQ(stats.allocated, 2);
  EXPECT_EQ(stats.reused, 0);
  EXPECT_EQ(stats.cached_bytes, 0);
}

// malloc/free that count, and can be told to fail.
struct CountedMemory {
  std::atomic<int> allocations{0};
  std::atomic<int> frees{0};
  std::atomic<bool> fail{false};

  CachingHostBufferPool::Options Options(int64_t max_cached_bytes) {
    CachingHostBufferPool::Options options;
    options.max_cached_bytes = max_cached_bytes;
    options.memory_name = "counted";
    options.allocate = [this](size_t bytes) -> void* {
      if (fail.load()) return nullptr;
      ++allocations;
      return std::malloc(bytes);
    };
    options.free = [this](void* data) {
      ++frees;
      std::free(data);
    };
    return options;
  }
};

TEST(CachingHostBufferPoolTest, ReleasedBuffersAreReusedBySize) {
  CountedMemory memory;
  auto pool = *CachingHostBufferPool::Create(memory.Options(1 << 20));
  char* first = nullptr;
  {
    HostBuffer a = pool->Acquire(1000);
    first = a.data();
    HostBuffer b = pool->Acquire(1000);
    EXPECT_NE(b.data(), first);
  }
  EXPECT_EQ(memory.allocations.load(), 2);
  EXPECT_EQ(pool->stats().cached_bytes, 2000);
  {
    // Same size: from the cache, no new allocation.
    HostBuffer a = pool->Acquire(1000);
    HostBuffer b = pool->Acquire(1000);
    EXPECT_TRUE(a.data() == first || b.data() == first);
    EXPECT_EQ(memory.allocations.load(), 2);
    EXPECT_EQ(pool->stats().cached_bytes, 0);
    // Another size is allocated, never served by a cached buffer.
    HostBuffer c = pool->Acquire(500);
    EXPECT_EQ(memory.allocations.load(), 3);
  }
  const CachingHostBufferPool::Stats stats = pool->stats();
  EXPECT_EQ(stats.allocated, 3);
  EXPECT_EQ(stats.reused, 2);
  EXPECT_EQ(stats.heap_fallbacks, 0);
  EXPECT_EQ(stats.cached_bytes, 2500);
  EXPECT_EQ(memory.frees.load(), 0);
  pool.reset();  // frees the cache
  EXPECT_EQ(memory.frees.load(), 3);
}

TEST(CachingHostBufferPoolTest, BuffersBeyondTheBoundAreFreedOnRelease) {
  CountedMemory memory;
  auto pool = *CachingHostBufferPool::Create(memory.Options(2500));
  {
    std::vector<HostBuffer> buffers;
    for (int i = 0; i < 4; ++i) buffers.push_back(pool->Acquire(1000));
  }
  // Two fit under 2500 bytes: each release past the bound freed the oldest.
  EXPECT_EQ(pool->stats().cached_bytes, 2000);
  EXPECT_EQ(pool->stats().freed, 2);
  EXPECT_EQ(memory.frees.load(), 2);
  pool.reset();
  EXPECT_EQ(memory.frees.load(), 4);

  // 0 keeps nothing.
  CountedMemory none;
  auto uncached = *CachingHostBufferPool::Create(none.Options(0));
  { HostBuffer a = uncached->Acquire(10); }
  EXPECT_EQ(none.frees.load(), 1);
  EXPECT_EQ(uncached->stats().cached_bytes, 0);
}

// Streams that change chunk size: the new size's buffers push the old
// size's out of a full cache, so the next projection at the new size
// allocates nothing (the first version kept the old size and freed every
// newcomer).
TEST(CachingHostBufferPoolTest, ANewSizeEvictsTheBuffersReleasedLongestAgo) {
  CountedMemory memory;
  auto pool = *CachingHostBufferPool::Create(memory.Options(4000));
  {
    std::vector<HostBuffer> small;
    for (int i = 0; i < 4; ++i) small.push_back(pool->Acquire(1000));
  }
  EXPECT_EQ(pool->stats().cached_bytes, 4000);
  char* newest = nullptr;
  {
    HostBuffer a = pool->Acquire(2000);
    HostBuffer b = pool->Acquire(2000);
    EXPECT_EQ(memory.allocations.load(), 6);
    a = HostBuffer();
    EXPECT_EQ(pool->stats().freed, 2);  // the two oldest 1000-byte buffers
    newest = b.data();
  }
  EXPECT_EQ(pool->stats().freed, 4);
  EXPECT_EQ(memory.frees.load(), 4);
  EXPECT_EQ(pool->stats().cached_bytes, 4000);
  {
    HostBuffer a = pool->Acquire(2000);
    EXPECT_EQ(a.data(), newest);  // newest release first
    HostBuffer b = pool->Acquire(2000);
    EXPECT_EQ(memory.allocations.load(), 6);
    // The old size is gone: served by new memory.
    HostBuffer c = pool->Acquire(1000);
    EXPECT_EQ(memory.allocations.load(), 7);
  }
  const CachingHostBufferPool::Stats stats = pool->stats();
  EXPECT_EQ(stats.reused, 2);
  EXPECT_EQ(stats.allocated, 7);
  // Released c, b, a (reverse declaration order): a's release went over
  // the bound and freed c, the oldest.
  EXPECT_EQ(stats.cached_bytes, 4000);
  EXPECT_EQ(stats.freed, 5);
}

TEST(CachingHostBufferPoolTest, FailedAllocationFallsBackToTheHeap) {
  CountedMemory memory;
  memory.fail = true;
  auto pool = *CachingHostBufferPool::Create(memory.Options(1 << 20));
  {
    HostBuffer a = pool->Acquire(4096);
    HostBuffer b = pool->Acquire(4096);  // warned once only
    ASSERT_NE(a.data(), nullptr);
    std::memset(a.data(), 1, a.bytes());
    EXPECT_EQ(a.bytes(), 4096u);
  }
  // Heap buffers go back to the heap, not into the cache or to `free`.
  EXPECT_EQ(pool->stats().heap_fallbacks, 2);
  EXPECT_EQ(pool->stats().cached_bytes, 0);
  EXPECT_EQ(memory.frees.load(), 0);
  memory.fail = false;
  { HostBuffer c = pool->Acquire(4096); }
  EXPECT_EQ(pool->stats().allocated, 1);
  EXPECT_EQ(pool->stats().cached_bytes, 4096);
}

// gRPC may drop a chunk after the service and the backend are gone: the
// buffer keeps the pool alive and returns to it, and the pool's last
// reference frees everything.
TEST(CachingHostBufferPoolTest, BuffersKeepThePoolAlive) {
  CountedMemory memory;
  auto pool = *CachingHostBufferPool::Create(memory.Options(1 << 20));
  std::weak_ptr<CachingHostBufferPool> watch = pool;
  HostBuffer cached = pool->Acquire(100);
  HostBuffer late = pool->Acquire(200);
  { HostBuffer returned = pool->Acquire(300); }
  pool.reset();
  EXPECT_FALSE(watch.expired());
  cached = HostBuffer();
  EXPECT_FALSE(watch.expired());
  EXPECT_EQ(memory.frees.load(), 0);
  late = HostBuffer();
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(memory.frees.load(), 3);
}

TEST(CachingHostBufferPoolTest, ManyThreadsAcquireAndRelease) {
  CountedMemory memory;
  auto pool = *CachingHostBufferPool::Create(memory.Options(64 << 10));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        HostBuffer buffer = pool->Acquire(1024 * (1 + (i + t) % 4));
        buffer.data()[0] = static_cast<char>(i);
        buffer.data()[buffer.bytes() - 1] = static_cast<char>(t);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const CachingHostBufferPool::Stats stats = pool->stats();
  EXPECT_EQ(stats.allocated + stats.reused, 8 * 500);
  EXPECT_LE(stats.cached_bytes, 64 << 10);
  EXPECT_EQ(memory.allocations.load(), stats.allocated);
  pool.reset();
  EXPECT_EQ(memory.frees.load(), memory.allocations.load());
}

TEST(CachingHostBufferPoolTest, BadOptionsNameTheField) {
  CountedMemory memory;
  CachingHostBufferPool::Options options = memory.Options(-1);
  auto negative = CachingHostBufferPool::Create(options);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("max_cached_bytes"), std::string::npos);
  options = memory.Options(0);
  options.allocate = nullptr;
  EXPECT_NE(CachingHostBufferPool::Create(options).status().message().find("allocate"),
            std::string::npos);
  options = memory.Options(0);
  options.free = nullptr;
  EXPECT_NE(CachingHostBufferPool::Create(options).status().message().find("free"),
            std::string::npos);
}

}  // namespace
}  // namespace detlogp::server
