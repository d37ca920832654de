// Backends of a build without CUDA (--config=nocuda).
#include "server/backend.h"
#include "server/cpu_backend.h"

namespace detlogp::server {

void RegisterBuiltinBackends(BackendRegistry* registry) {
  registry->Register("cpu", CreateCpuBackend);
}

}  // namespace detlogp::server
