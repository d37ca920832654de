#include "server/backends/host_buffer_pool.h"

#include <atomic>

namespace detlogp::server {
namespace {

class HeapHostBufferPool final : public HostBufferPool {
 public:
  HostBuffer Acquire(size_t bytes) override {
    allocated_.fetch_add(1, std::memory_order_relaxed);
    return HeapHostBuffer(bytes);
  }
  // The heap is this pool's kind of memory: every buffer is new, none kept.
  Stats stats() const override {
    Stats stats;
    stats.allocated = allocated_.load(std::memory_order_relaxed);
    return stats;
  }

 private:
  std::atomic<int64_t> allocated_{0};
};

}  // namespace

HostBuffer HeapHostBuffer(size_t bytes) {
  // Left uninitialised: the projection overwrites every byte it sends.
  std::unique_ptr<char[]> data(new char[bytes == 0 ? 1 : bytes]);
  return HostBuffer(data.release(), bytes,
                    [](char* released, size_t) { delete[] released; });
}

std::shared_ptr<HostBufferPool> NewHeapHostBufferPool() {
  return std::make_shared<HeapHostBufferPool>();
}

}  // namespace detlogp::server
