#include "server/backends/caching_host_buffer_pool.h"

#include <spdlog/spdlog.h>

#include <iterator>
#include <utility>

namespace detlogp::server {

absl::StatusOr<std::shared_ptr<CachingHostBufferPool>> CachingHostBufferPool::Create(
    const Options& options) {
  if (options.max_cached_bytes < 0) {
    return absl::InvalidArgumentError(
        "max_cached_bytes: must be >= 0 (0 caches nothing)");
  }
  if (!options.allocate) return absl::InvalidArgumentError("allocate: not set");
  if (!options.free) return absl::InvalidArgumentError("free: not set");
  return std::shared_ptr<CachingHostBufferPool>(new CachingHostBufferPool(options));
}

CachingHostBufferPool::~CachingHostBufferPool() {
  absl::MutexLock lock(&mu_);
  for (const Cached& buffer : cached_) options_.free(buffer.data);
}

HostBuffer CachingHostBufferPool::Acquire(size_t bytes) {
  char* data = nullptr;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = cached_.rbegin(); it != cached_.rend(); ++it) {
      if (it->bytes != bytes) continue;
      data = it->data;
      cached_.erase(std::next(it).base());
      stats_.cached_bytes -= static_cast<int64_t>(bytes);
      ++stats_.reused;
      break;
    }
  }
  if (data == nullptr) {
    // Outside the lock: pinning tens of MB takes milliseconds.
    data = static_cast<char*>(options_.allocate(bytes == 0 ? 1 : bytes));
    absl::MutexLock lock(&mu_);
    if (data == nullptr) {
      ++stats_.heap_fallbacks;
    } else {
      ++stats_.allocated;
    }
  }
  if (data == nullptr) {
    if (!warned_.exchange(true)) {
      spdlog::warn("cannot allocate {} bytes of {} memory; chunk buffers that "
                   "cannot be had fall back to the heap (slower copies)",
                   bytes, options_.memory_name);
    }
    return HeapHostBuffer(bytes);
  }
  return HostBuffer(data, bytes,
                    [pool = shared_from_this()](char* released, size_t size) {
                      pool->Release(released, size);
                    });
}

void CachingHostBufferPool::Release(char* data, size_t bytes) {
  std::vector<char*> evicted;
  {
    absl::MutexLock lock(&mu_);
    cached_.push_back({bytes, data});
    stats_.cached_bytes += static_cast<int64_t>(bytes);
    while (stats_.cached_bytes > options_.max_cached_bytes) {
      const Cached& oldest = cached_.front();
      evicted.push_back(oldest.data);
      stats_.cached_bytes -= static_cast<int64_t>(oldest.bytes);
      cached_.pop_front();
    }
    stats_.freed += static_cast<int64_t>(evicted.size());
  }
  for (char* buffer : evicted) options_.free(buffer);
}

CachingHostBufferPool::Stats CachingHostBufferPool::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace detlogp::server
