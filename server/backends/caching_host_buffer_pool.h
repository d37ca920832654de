// A HostBufferPool that pins memory in large blocks and carves buffers of
// any size out of them (best fit, freed ranges coalesced with their
// neighbours), so that streams changing chunk size reuse the same pinned
// memory instead of pinning more. A block is given back to the system only
// when nothing in it is in use and the idle pinned bytes exceed a bound;
// then the blocks idle longest go first.
//
// Why blocks: a cache of whole buffers by exact size thrashes. A sweep over
// 256-2048 rows per chunk needs 1.14 GB of buffers of four sizes but at
// most 352 MB at once; such a cache bounded at 1 GiB re-pins 2048-row
// buffers and frees smaller ones every round, and cudaHostAlloc /
// cudaFreeHost stall every stream's launches (the first 2048-row run of a
// round ran 13 % slower on the H200 host). Carved from blocks, the sweep
// needs what is in use at once. The same design as the BFC allocator
// TensorFlow uses for pinned host memory, simplified: buffers are few and
// large (chunks of 5-44 MB), so plain ordered maps do.
//
// The memory comes from Options::allocate (the CUDA projection backend:
// cudaHostAlloc); when it fails, Acquire falls back to the heap for that
// buffer and warns once.
//
// Thread-safe. Every buffer it hands out holds a reference to the pool, so
// the pool (and its free function) lives until the last buffer is back,
// whoever dropped it last: gRPC may hold a chunk after its stream ended.
// Options::allocate and Options::free run outside the pool's lock (pinning
// and unpinning take milliseconds).
#ifndef DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_
#define DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/backends/host_buffer_pool.h"

namespace detlogp::server {

class CachingHostBufferPool final
    : public HostBufferPool,
      public std::enable_shared_from_this<CachingHostBufferPool> {
 public:
  // Buffers start at multiples of this within a block (a page).
  static constexpr size_t kAlignment = 4096;

  struct Options {
    // Idle bytes (pinned, in no buffer) kept for reuse; past it, blocks with
    // nothing in use are freed, idle longest first. 0 frees every buffer's
    // memory on release.
    int64_t max_cached_bytes = int64_t{1} << 30;
    // Memory is obtained in blocks of at least this many bytes (capped at
    // max_cached_bytes, so that a small bound does not pin more than it
    // keeps), or of the buffer's size when larger.
    int64_t block_bytes = int64_t{128} << 20;
    // Allocates `bytes` (> 0) of host memory; nullptr on failure. Called
    // without the pool's lock held.
    std::function<void*(size_t bytes)> allocate;
    // Frees what allocate returned; called from whichever thread releases a
    // buffer, or from the destructor.
    std::function<void(void* data)> free;
    // The memory's kind in the fallback warning ("pinned").
    std::string memory_name = "host";
  };

  // INVALID_ARGUMENT naming the field for a negative max_cached_bytes, a
  // block_bytes below 1, or a missing allocate/free.
  static absl::StatusOr<std::shared_ptr<CachingHostBufferPool>> Create(
      const Options& options);
  // Frees the blocks (every handed-out buffer is back by now).
  ~CachingHostBufferPool() override;
  CachingHostBufferPool(const CachingHostBufferPool&) = delete;
  CachingHostBufferPool& operator=(const CachingHostBufferPool&) = delete;

  HostBuffer Acquire(size_t bytes) override;
  // allocated: Acquires that needed a new block; reused: Acquires carved
  // from blocks already held; freed: blocks given back; cached_bytes: idle
  // bytes in the blocks held.
  Stats stats() const override;
  // Bytes of the blocks held now, in use or idle (tests, logs).
  int64_t held_bytes() const;

 private:
  struct Block {
    char* base = nullptr;
    size_t bytes = 0;
    // Idle ranges: offset -> length, none adjacent (they coalesce).
    std::map<size_t, size_t> idle;
    // When its last buffer came back (a release count), for eviction.
    int64_t last_release = 0;
  };
  // An idle range in the best-fit index, ordered by length, then address
  // (the lowest of the fitting ranges wins: the same reuse every time).
  struct IdleRange {
    size_t length;
    uintptr_t start;
    Block* block;
    size_t offset;
    bool operator<(const IdleRange& other) const {
      return length != other.length ? length < other.length
                                    : start < other.start;
    }
  };

  explicit CachingHostBufferPool(const Options& options) : options_(options) {}
  static size_t Rounded(size_t bytes);
  HostBuffer Lend(Block* block, size_t offset, size_t bytes);
  void Release(Block* block, char* data, size_t bytes);
  void AddIdleLocked(Block* block, size_t offset, size_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveIdleLocked(Block* block, std::map<size_t, size_t>::iterator range)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  std::atomic<bool> warned_{false};
  mutable absl::Mutex mu_;
  std::list<Block> blocks_ ABSL_GUARDED_BY(mu_);  // stable addresses
  std::set<IdleRange> idle_by_size_ ABSL_GUARDED_BY(mu_);
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_
