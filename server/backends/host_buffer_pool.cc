#include "server/backends/host_buffer_pool.h"

namespace detlogp::server {
namespace {

class HeapHostBufferPool final : public HostBufferPool {
 public:
  HostBuffer Acquire(size_t bytes) override { return HeapHostBuffer(bytes); }
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
