// Backends of a build without CUDA (--config=nocuda).
#include "server/backends/backend.h"
#include "server/backends/cpu_backend.h"
#include "server/backends/projection_backend.h"

namespace detlogp::server {

void RegisterBuiltinBackends(LogpBackendRegistry* registry) {
  registry->Register("cpu", CreateCpuBackend);
}

void RegisterBuiltinBackends(ProjectionBackendRegistry* registry) {
  registry->Register("cpu", CreateCpuProjectionBackend);
}

}  // namespace detlogp::server
