// The projection's compute boundary: the server fills an executor's staging
// with rows of X and runs it, naming where each chunk's rows of Y go;
// backends (CPU, CUDA) keep the contract that every output element is the
// fixed fma chain of kernels/projection.h, so the CPU and CUDA paths give
// identical bits. A backend also hands out the host memory those chunks
// live in (host_buffer_pool), so that its executors can write Y there
// directly: the CUDA backend's is pinned and takes the device's copy.
#ifndef DETLOGP_SERVER_BACKENDS_PROJECTION_BACKEND_H_
#define DETLOGP_SERVER_BACKENDS_PROJECTION_BACKEND_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/backends/backend.h"
#include "server/backends/backend_registry.h"
#include "server/backends/host_buffer_pool.h"
#include "server/models/projection_weights.h"

namespace detlogp::server {

struct ProjectionStaging {
  int64_t capacity = 0;  // rows
  float* x = nullptr;    // [capacity, 96], filled before Run
};

// Where `rows` consecutive rows of a launch's Y go: [rows, 5376] at y.
struct YDestination {
  float* y = nullptr;
  int64_t rows = 0;
};

// Where a Run's time went, beyond the device's.
struct ProjectionRunStats {
  // Host time copying Y out of the executor's own staging into the
  // destinations; 0 when Y went to them directly.
  double copy_out_seconds = 0;
};

class ProjectionExecutor {
 public:
  virtual ~ProjectionExecutor() = default;
  virtual ProjectionStaging staging() = 0;
  // Projects staging's first `rows` rows of X: the first outputs[0].rows
  // rows of Y into outputs[0].y, the next ones into outputs[1].y, and so on
  // (the pieces' rows sum to `rows`). `stats` may be null.
  virtual absl::Status Run(int64_t rows, absl::Span<const YDestination> outputs,
                           ProjectionRunStats* stats) = 0;
};

// INTERNAL unless 0 <= rows <= capacity and the pieces' rows (each >= 0,
// y set) sum to `rows`: the executors' check of a launch.
absl::Status CheckLaunch(int64_t rows, int64_t capacity,
                         absl::Span<const YDestination> outputs);

// For executors that compute into staging of their own: copies Y's rows
// from `y` ([rows, 5376], the pieces in order) into the destinations and
// returns the seconds it took.
double CopyOutOfStaging(const float* y, absl::Span<const YDestination> outputs);

class ProjectionBackend {
 public:
  virtual ~ProjectionBackend() = default;
  virtual const BackendDescription& description() const = 0;
  virtual absl::StatusOr<std::unique_ptr<ProjectionExecutor>> NewExecutor(
      int64_t max_rows) = 0;
  // The memory for the Y destinations this backend's executors are given
  // (the service's chunk buffers). The default is plain heap memory.
  virtual std::shared_ptr<HostBufferPool> host_buffer_pool() {
    return NewHeapHostBufferPool();
  }
};

struct ProjectionBackendOptions {
  const ProjectionWeights* weights = nullptr;  // outlives the backend
  int device_index = 0;
  int cpu_threads = 0;
  // Bytes of released chunk buffers a backend with its own host memory
  // (CUDA: pinned) keeps for reuse; the rest are freed on release.
  int64_t max_cached_host_buffer_bytes = int64_t{1} << 30;
};

using ProjectionBackendRegistry =
    BackendRegistry<ProjectionBackend, ProjectionBackendOptions>;

void RegisterBuiltinBackends(ProjectionBackendRegistry* registry);

absl::StatusOr<std::unique_ptr<ProjectionBackend>> CreateCpuProjectionBackend(
    const ProjectionBackendOptions& options);
// UNAVAILABLE without an sm_90 GPU; only in CUDA builds.
absl::StatusOr<std::unique_ptr<ProjectionBackend>> CreateCudaProjectionBackend(
    const ProjectionBackendOptions& options);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_PROJECTION_BACKEND_H_
