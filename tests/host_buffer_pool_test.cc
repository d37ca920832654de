// The chunk buffers' allocators on the CPU: the heap pool, and the caching
// pool the CUDA backend fills with pinned memory, here with counted
// malloc/free in place of cudaHostAlloc/cudaFreeHost: buffers of any size
// carved from blocks, coalescing, the bound on idle bytes, the heap
// fallback, buffers outliving the pool, and several threads at once.
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

  CachingHostBufferPool::Options Options(int64_t max_cached_bytes,
                                         int64_t block_bytes = 1 << 20) {
    CachingHostBufferPool::Options options;
    options.max_cached_bytes = max_cached_bytes;
    options.block_bytes = block_bytes;
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

constexpr int64_t kPage = CachingHostBufferPool::kAlignment;

TEST(CachingHostBufferPoolTest, CarvesBuffersOfAnySizeFromOneBlock) {
  CountedMemory memory;
  auto pool =
      *CachingHostBufferPool::Create(memory.Options(1 << 20, 16 * kPage));
  {
    std::vector<HostBuffer> buffers;
    for (size_t bytes : {size_t{1000}, size_t{5000}, size_t{3 * kPage}}) {
      buffers.push_back(pool->Acquire(bytes));
      EXPECT_EQ(buffers.back().bytes(), bytes);
    }
    EXPECT_EQ(memory.allocations.load(), 1);
    EXPECT_EQ(pool->held_bytes(), 16 * kPage);
    // Disjoint: each buffer keeps what was written into it.
    for (size_t i = 0; i < buffers.size(); ++i) {
      std::memset(buffers[i].data(), static_cast<int>('a' + i),
                  buffers[i].bytes());
    }
    for (size_t i = 0; i < buffers.size(); ++i) {
      for (size_t b = 0; b < buffers[i].bytes(); ++b) {
        ASSERT_EQ(buffers[i].data()[b], static_cast<char>('a' + i))
            << i << " " << b;
      }
    }
    EXPECT_EQ(pool->stats().cached_bytes, (16 - 1 - 2 - 3) * kPage);
  }
  EXPECT_EQ(pool->stats().cached_bytes, 16 * kPage);
  {
    // Every size is served by the same block, coalesced again.
    HostBuffer large = pool->Acquire(10 * kPage);
    EXPECT_EQ(memory.allocations.load(), 1);
  }
  const CachingHostBufferPool::Stats stats = pool->stats();
  EXPECT_EQ(stats.allocated, 1);
  EXPECT_EQ(stats.reused, 3);
  EXPECT_EQ(stats.heap_fallbacks, 0);
  EXPECT_EQ(memory.frees.load(), 0);
  pool.reset();  // frees the block
  EXPECT_EQ(memory.frees.load(), 1);
}

TEST(CachingHostBufferPoolTest, FreedNeighboursCoalesce) {
  CountedMemory memory;
  auto pool =
      *CachingHostBufferPool::Create(memory.Options(1 << 20, 4 * kPage));
  HostBuffer a = pool->Acquire(kPage);
  HostBuffer b = pool->Acquire(kPage);
  HostBuffer c = pool->Acquire(kPage - 1);
  HostBuffer d = pool->Acquire(kPage);
  EXPECT_EQ(memory.allocations.load(), 1);
  char* const base = a.data();
  char* const b_data = b.data();
  // b then c: c's page joins b's, so two pages fit where they were.
  b = HostBuffer();
  c = HostBuffer();
  HostBuffer two = pool->Acquire(2 * kPage);
  EXPECT_EQ(two.data(), b_data);
  EXPECT_EQ(memory.allocations.load(), 1);
  // d, then a, then the two pages between them: one range again.
  d = HostBuffer();
  a = HostBuffer();
  two = HostBuffer();
  HostBuffer whole = pool->Acquire(4 * kPage);
  EXPECT_EQ(whole.data(), base);
  EXPECT_EQ(memory.allocations.load(), 1);
}

TEST(CachingHostBufferPoolTest,
     IdleBlocksBeyondTheBoundAreFreedIdleLongestFirst) {
  CountedMemory memory;
  auto pool =
      *CachingHostBufferPool::Create(memory.Options(2 * kPage, 2 * kPage));
  HostBuffer x = pool->Acquire(2 * kPage);
  HostBuffer y = pool->Acquire(2 * kPage);
  HostBuffer z = pool->Acquire(2 * kPage);
  char* const z_data = z.data();
  EXPECT_EQ(memory.allocations.load(), 3);
  x = HostBuffer();
  EXPECT_EQ(memory.frees.load(), 0);  // 2 pages idle: at the bound
  y = HostBuffer();
  EXPECT_EQ(memory.frees.load(), 1);  // x's block, idle longest
  z = HostBuffer();
  EXPECT_EQ(memory.frees.load(), 2);  // then y's
  EXPECT_EQ(pool->stats().freed, 2);
  EXPECT_EQ(pool->stats().cached_bytes, 2 * kPage);
  EXPECT_EQ(pool->held_bytes(), 2 * kPage);
  HostBuffer again = pool->Acquire(2 * kPage);
  EXPECT_EQ(again.data(), z_data);

  // 0 keeps nothing: every buffer's block is its own, freed on release.
  CountedMemory none;
  auto uncached = *CachingHostBufferPool::Create(none.Options(0));
  { HostBuffer a = uncached->Acquire(10); }
  EXPECT_EQ(none.allocations.load(), 1);
  EXPECT_EQ(none.frees.load(), 1);
  EXPECT_EQ(uncached->stats().cached_bytes, 0);
  EXPECT_EQ(uncached->held_bytes(), 0);
}

TEST(CachingHostBufferPoolTest, BlocksWithABufferOutAreNeverFreed) {
  CountedMemory memory;
  auto pool =
      *CachingHostBufferPool::Create(memory.Options(2 * kPage, 2 * kPage));
  HostBuffer a = pool->Acquire(kPage);
  HostBuffer b = pool->Acquire(kPage);  // a's block, second page
  HostBuffer c = pool->Acquire(2 * kPage);
  EXPECT_EQ(memory.allocations.load(), 2);
  a = HostBuffer();
  c = HostBuffer();  // 3 pages idle: only c's block can go
  EXPECT_EQ(memory.frees.load(), 1);
  EXPECT_EQ(pool->stats().cached_bytes, kPage);
  std::memset(b.data(), 7, b.bytes());  // still ours (ASan-clean)
  b = HostBuffer();
  EXPECT_EQ(memory.frees.load(), 1);  // 2 pages idle: kept
  EXPECT_EQ(pool->held_bytes(), 2 * kPage);
}

// Projections that change chunk size, as a sweep over 256-2048 rows per
// chunk does: each holds four buffers of its size at once, and the sizes
// together need more than the bound, the peak at once does not. Carved
// from blocks, everything after the first projection reuses the first
// block (a cache of whole buffers by size pinned and freed buffers every
// round).
TEST(CachingHostBufferPoolTest, ChangingSizesReuseTheSameMemory) {
  CountedMemory memory;
  auto pool =
      *CachingHostBufferPool::Create(memory.Options(16 * kPage, 16 * kPage));
  for (int round = 0; round < 3; ++round) {
    for (int64_t pages : {1, 2, 4, 4, 2, 1}) {
      std::vector<HostBuffer> in_use;
      for (int i = 0; i < 4; ++i)
        in_use.push_back(pool->Acquire(pages * kPage - 100));
    }
  }
  EXPECT_EQ(memory.allocations.load(), 1);
  EXPECT_EQ(memory.frees.load(), 0);
  EXPECT_EQ(pool->stats().reused, 3 * 6 * 4 - 1);
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
  // Heap buffers go back to the heap, not into the pool or to `free`.
  EXPECT_EQ(pool->stats().heap_fallbacks, 2);
  EXPECT_EQ(pool->stats().cached_bytes, 0);
  EXPECT_EQ(memory.frees.load(), 0);
  memory.fail = false;
  { HostBuffer c = pool->Acquire(4096); }
  EXPECT_EQ(pool->stats().allocated, 1);
  EXPECT_EQ(pool->stats().cached_bytes, 1 << 20);
  EXPECT_EQ(pool->held_bytes(), 1 << 20);
}

// gRPC may drop a chunk after the service and the backend are gone: the
// buffer keeps the pool alive and returns to it, and the pool's last
// reference frees everything.
TEST(CachingHostBufferPoolTest, BuffersKeepThePoolAlive) {
  CountedMemory memory;
  auto pool =
      *CachingHostBufferPool::Create(memory.Options(1 << 20, 2 * kPage));
  std::weak_ptr<CachingHostBufferPool> watch = pool;
  HostBuffer cached = pool->Acquire(100);
  HostBuffer late = pool->Acquire(200);
  { HostBuffer returned = pool->Acquire(300); }
  EXPECT_EQ(memory.allocations.load(), 2);
  pool.reset();
  EXPECT_FALSE(watch.expired());
  cached = HostBuffer();
  EXPECT_FALSE(watch.expired());
  EXPECT_EQ(memory.frees.load(), 0);
  late = HostBuffer();
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(memory.frees.load(), 2);
}

TEST(CachingHostBufferPoolTest, ManyThreadsAcquireAndRelease) {
  CountedMemory memory;
  auto pool =
      *CachingHostBufferPool::Create(memory.Options(64 << 10, 16 << 10));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        HostBuffer buffer = pool->Acquire(1024 * (1 + (i + t) % 4) + t);
        std::memset(buffer.data(), t, buffer.bytes());
        for (size_t b = 0; b < buffer.bytes(); b += 97) {
          ASSERT_EQ(buffer.data()[b], static_cast<char>(t));  // no one else's
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const CachingHostBufferPool::Stats stats = pool->stats();
  EXPECT_EQ(stats.allocated + stats.reused, 8 * 500);
  EXPECT_EQ(stats.heap_fallbacks, 0);
  // Everything is back: every block idle, and no more of them than the bound.
  EXPECT_EQ(stats.cached_bytes, pool->held_bytes());
  EXPECT_LE(stats.cached_bytes, 64 << 10);
  EXPECT_EQ(memory.allocations.load(), stats.allocated);
  EXPECT_EQ(memory.frees.load(), stats.freed);
  pool.reset();
  EXPECT_EQ(memory.frees.load(), memory.allocations.load());
}

TEST(CachingHostBufferPoolTest, BadOptionsNameTheField) {
  CountedMemory memory;
  CachingHostBufferPool::Options options = memory.Options(-1);
  auto negative = CachingHostBufferPool::Create(options);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("max_cached_bytes"),
            std::string::npos);
  options = memory.Options(0, 0);
  EXPECT_NE(CachingHostBufferPool::Create(options).status().message().find(
                "block_bytes"),
            std::string::npos);
  options = memory.Options(0);
  options.allocate = nullptr;
  EXPECT_NE(CachingHostBufferPool::Create(options).status().message().find(
                "allocate"),
            std::string::npos);
  options = memory.Options(0);
  options.free = nullptr;
  EXPECT_NE(
      CachingHostBufferPool::Create(options).status().message().find("free"),
      std::string::npos);
}

}  // namespace
}  // namespace detlogp::server
