#include "client/grpc_lifetime.h"

#include <grpc/grpc.h>

namespace detlogp::client {

void KeepGrpcInitialized() {
  // One reference for the process, taken once; its grpc_shutdown never runs.
  static const bool initialized = (grpc_init(), true);
  (void)initialized;
}

}  // namespace detlogp::client
