// Where a request's hidden rows live, so the batcher can let a device
// backend copy them itself (straight to the GPU) instead of gathering them
// into host staging first. Plain C++: no backend, no CUDA.
#ifndef DETLOGP_SERVER_BACKENDS_HIDDEN_LOCATION_H_
#define DETLOGP_SERVER_BACKENDS_HIDDEN_LOCATION_H_

#include <string>

namespace detlogp::server {

struct HiddenLocation {
  enum class Kind {
    // Ordinary host memory: gRPC's message, converted rows.
    kHost,
    // Host memory the backend registered for direct copies (a system
    // shared-memory region pinned with LogpBackend::PinHostMemory).
    kPinnedHost,
    // Device memory on CUDA device `device` (an opened CUDA region). Only
    // an executor that copies such rows itself can read them.
    kDevice,
  };
  Kind kind = Kind::kHost;
  int device = -1;  // kDevice only
  // Host memory (kHost or kPinnedHost) that can vanish under a read: a
  // system shared-memory region's mapping, whose owner may truncate the
  // object at any time (a CPU read then faults with SIGBUS). The CPU reads
  // such rows only through CopyFromMapping
  // (server/shared_memory/mapped_reads.h).
  bool owner_may_truncate = false;
  // The shared-memory region the rows are in, for errors; empty otherwise.
  std::string region;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_HIDDEN_LOCATION_H_
