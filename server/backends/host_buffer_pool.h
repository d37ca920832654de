// Host memory for the projection's chunk buffers, handed out by the
// projection backend: the service's chunks are the executor's output
// destinations, so a backend that copies faster into memory of its own
// choosing (the CUDA backend: pinned) supplies it here.
//
// A HostBuffer owns its memory and gives it back to its pool when
// destroyed. gRPC may hold a chunk buffer after its stream (and even the
// service) is gone, so a pool's release path keeps whatever it needs alive
// by itself: a pool may be destroyed while its buffers are still out.
#ifndef DETLOGP_SERVER_BACKENDS_HOST_BUFFER_POOL_H_
#define DETLOGP_SERVER_BACKENDS_HOST_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

namespace detlogp::server {

class HostBuffer {
 public:
  // Called once with the buffer's data and size when the handle goes.
  using Release = std::function<void(char* data, size_t bytes)>;

  HostBuffer() = default;
  HostBuffer(char* data, size_t bytes, Release release)
      : data_(data), bytes_(bytes), release_(std::move(release)) {}
  HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      release_ = std::move(other.release_);
      other.release_ = nullptr;
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { Reset(); }

  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (release_ != nullptr) std::exchange(release_, nullptr)(data_, bytes_);
    data_ = nullptr;
    bytes_ = 0;
  }

  char* data_ = nullptr;
  size_t bytes_ = 0;
  Release release_;
};

class HostBufferPool {
 public:
  // What a pool has done since it was made (metrics, tests).
  struct Stats {
    int64_t allocated =
        0;               // Acquires that needed new memory of the pool's kind
    int64_t reused = 0;  // Acquires served by memory the pool already held
    int64_t heap_fallbacks =
        0;              // Acquires served by the heap: the pool's kind failed
    int64_t freed = 0;  // allocations a caching pool gave back (blocks)
    int64_t cached_bytes = 0;  // bytes held idle for reuse now
  };

  virtual ~HostBufferPool() = default;
  // `bytes` of uninitialised host memory. Never fails for want of the
  // pool's kind of memory: a pool falls back to the heap (new[] may still
  // throw, as any allocation).
  virtual HostBuffer Acquire(size_t bytes) = 0;
  virtual Stats stats() const = 0;
};

// Plain heap memory, allocated and freed per buffer: what a backend that does
// not care about its output memory provides.
std::shared_ptr<HostBufferPool> NewHeapHostBufferPool();

// A heap buffer of `bytes`, freed when the handle goes (the fallback of
// every pool).
HostBuffer HeapHostBuffer(size_t bytes);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_HOST_BUFFER_POOL_H_
