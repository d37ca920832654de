// The projection's compute boundary: the server fills an executor's staging
// with rows of X and runs it; backends (CPU, CUDA) keep the contract that
// every output element is the fixed fma chain of kernels/projection.h, so the
// CPU and CUDA paths give identical bits.
#ifndef DETLOGP_SERVER_BACKENDS_PROJECTION_BACKEND_H_
#define DETLOGP_SERVER_BACKENDS_PROJECTION_BACKEND_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"
#include "server/backends/backend_registry.h"
#include "server/models/projection_weights.h"

namespace detlogp::server {

struct ProjectionStaging {
  int64_t capacity = 0;  // rows
  float* x = nullptr;    // [capacity, 96]
  float* y = nullptr;    // [capacity, 5376], written by Run
};

class ProjectionExecutor {
 public:
  virtual ~ProjectionExecutor() = default;
  virtual ProjectionStaging staging() = 0;
  virtual absl::Status Run(int64_t rows) = 0;
};

class ProjectionBackend {
 public:
  virtual ~ProjectionBackend() = default;
  virtual const BackendDescription& description() const = 0;
  virtual absl::StatusOr<std::unique_ptr<ProjectionExecutor>> NewExecutor(
      int64_t max_rows) = 0;
};

struct ProjectionBackendOptions {
  const ProjectionWeights* weights = nullptr;  // outlives the backend
  int device_index = 0;
  int cpu_threads = 0;
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
