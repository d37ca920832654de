// A HostBufferPool that recycles its buffers: released buffers are kept for
// the next Acquire of their size, up to a bound on the bytes kept. When a
// release goes over the bound, the buffers released longest ago are freed,
// whatever their size: a server whose streams change chunk size keeps the
// buffers of the sizes in use. (Freeing the newcomer instead, as the first
// version did, left a cache full of an earlier size: on the H200 a sweep
// over 256-2048 rows per chunk then pinned and freed 44 MB buffers during
// every 2048-row projection, and those ran 10-14 % slower; docs/perf.md,
// session 14.) The memory comes from Options::allocate (the CUDA projection
// backend: cudaHostAlloc, whose cost is paid once per buffer instead of once
// per chunk); when allocate fails, Acquire falls back to the heap for that
// buffer and warns once.
//
// Thread-safe. Every buffer it hands out holds a reference to the pool, so
// the pool (and its free function) lives until the last buffer is back,
// whoever dropped it last: gRPC may hold a chunk after its stream ended.
// Options::free runs outside the pool's lock (cudaFreeHost may wait).
#ifndef DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_
#define DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
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

  // INVALID_ARGUMENT naming the field for a negative max_cached_bytes or a
  // missing allocate/free.
  static absl::StatusOr<std::shared_ptr<CachingHostBufferPool>> Create(
      const Options& options);
  // Frees the cached buffers (every handed-out one is back by now).
  ~CachingHostBufferPool() override;
  CachingHostBufferPool(const CachingHostBufferPool&) = delete;
  CachingHostBufferPool& operator=(const CachingHostBufferPool&) = delete;

  HostBuffer Acquire(size_t bytes) override;
  Stats stats() const override;

 private:
  explicit CachingHostBufferPool(const Options& options) : options_(options) {}
  void Release(char* data, size_t bytes);

  const Options options_;
  std::atomic<bool> warned_{false};
  mutable absl::Mutex mu_;
  struct Cached {
    size_t bytes;
    char* data;
  };
  // Released buffers, oldest release first. Reuse is by exact size (a
  // stream's ring asks for one size, and a larger buffer reused for a
  // smaller chunk would hold memory idle), newest first. A list scanned
  // linearly: it holds at most a few hundred chunk buffers (1 GiB of the
  // smallest, 5.5 MB), each worth milliseconds of transfer.
  std::list<Cached> cached_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CACHING_HOST_BUFFER_POOL_H_
