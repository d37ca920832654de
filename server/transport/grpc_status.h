// The one place where absl::Status becomes grpc::Status.
#ifndef DETLOGP_SERVER_TRANSPORT_GRPC_STATUS_H_
#define DETLOGP_SERVER_TRANSPORT_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace detlogp::server {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_GRPC_STATUS_H_
