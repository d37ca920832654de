// The CUDA backend: the fused linear-logp kernel of kernels/cuda on one GPU.
// Weights are uploaded once; each executor owns a stream, pinned host staging
// and device buffers, so two executors overlap one batch's copies with the
// other's compute.
#ifndef DETLOGP_SERVER_BACKENDS_CUDA_BACKEND_H_
#define DETLOGP_SERVER_BACKENDS_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"

namespace detlogp::server {

// UNAVAILABLE when the machine has no suitable GPU (compute capability >= 8.0,
// or 9.0 with --logp_kernel=hopper); see cuda_device_selection.h.
absl::StatusOr<std::unique_ptr<LogpBackend>> CreateCudaBackend(
    const BackendOptions& options);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CUDA_BACKEND_H_
