// Backends of the default build: CUDA first (used by --device=auto when an
// sm_90 GPU is present), then the CPU.
#include "server/backends/backend.h"
#include "server/backends/cpu_backend.h"
#include "server/backends/projection_backend.h"
#include "server/backends/cuda_backend.h"

namespace detlogp::server {

void RegisterBuiltinBackends(LogpBackendRegistry* registry) {
  registry->Register("cuda", CreateCudaBackend);
  registry->Register("cpu", CreateCpuBackend);
}

void RegisterBuiltinBackends(ProjectionBackendRegistry* registry) {
  registry->Register("cuda", CreateCudaProjectionBackend);
  registry->Register("cpu", CreateCpuProjectionBackend);
}

}  // namespace detlogp::server
