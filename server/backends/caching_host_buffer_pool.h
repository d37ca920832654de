// A HostBufferPool that recycles its buffers: released buffers are kept,
// by size, for the next Acquire of that size, up to a bound on the bytes
// kept; buffers beyond it are freed at once. The memory comes from
// Options::allocate (the CUDA projection backend: cudaHostAlloc, whose cost
// is paid once per buffer instead of once per chunk); when allocate fails,
// Acquire falls back to the heap for that buffer and warns once.
//
// Thread-safe. Every buffer it hands out holds a reference to the pool, so
// the pool (and its free function) lives until the last buffer is back,
// whoever dropped it last: gRPC may hold a chunk after its stream ended.
#ifndef DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_
#define DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/backends/host_buffer_pool.h"

namespace detlogp::server {

class CachingHostBufferPool final
    : public HostBufferPool,
      public std::enable_shared_from_this<CachingHostBufferPool> {
 public:
  struct Options {
    // Bytes of released buffers kept for reuse; 0 frees every buffer on
    // release.
    int64_t max_cached_bytes = int64_t{1} << 30;
    // Allocates `bytes` (> 0) of host memory; nullptr on failure. Called
    // without the pool's lock held.
    std::function<void*(size_t bytes)> allocate;
    // Frees what allocate returned; called from whichever thread releases a
    // buffer, or from the destructor.
    std::function<void(void* data)> free;
    // The memory's kind in the fallback warning ("pinned").
    std::string memory_name = "host";
  };

  // What the pool has done so far (tests, logs).
  struct Stats {
    int64_t allocated = 0;      // buffers from allocate
    int64_t reused = 0;         // Acquires served from the cache
    int64_t heap_fallbacks = 0; // Acquires served from the heap
    int64_t cached_bytes = 0;   // bytes held for reuse now
  };

  // INVALID_ARGUMENT naming the field for a negative max_cached_bytes or a
  // missing allocate/free.
  static absl::StatusOr<std::shared_ptr<CachingHostBufferPool>> Create(
      const Options& options);
  // Frees the cached buffers (every handed-out one is back by now).
  ~CachingHostBufferPool() override;
  CachingHostBufferPool(const CachingHostBufferPool&) = delete;
  CachingHostBufferPool& operator=(const CachingHostBufferPool&) = delete;

  HostBuffer Acquire(size_t bytes) override;
  Stats stats() const;

 private:
  explicit CachingHostBufferPool(const Options& options) : options_(options) {}
  void Release(char* data, size_t bytes);

  const Options options_;
  std::atomic<bool> warned_{false};
  mutable absl::Mutex mu_;
  // Released buffers by exact size: a stream's ring asks for one size, and
  // a larger buffer reused for a smaller chunk would hold memory idle.
  absl::flat_hash_map<size_t, std::vector<char*>> free_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_
