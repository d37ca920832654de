// The CPU backend: the embedded default on machines without a GPU, and the
// one CI tests. Runs kernels/linear_logp_cpu over a thread pool per executor.
#ifndef DETLOGP_SERVER_BACKENDS_CPU_BACKEND_H_
#define DETLOGP_SERVER_BACKENDS_CPU_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"

namespace detlogp::server {

absl::StatusOr<std::unique_ptr<LogpBackend>> CreateCpuBackend(
    const BackendOptions& options);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CPU_BACKEND_H_
