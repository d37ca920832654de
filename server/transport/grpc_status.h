// The one place where absl::Status becomes grpc::Status: the code, the
// message and the details (google.rpc.Status in error_details(), with an
// ErrorInfo always; proto/status_details.h).
#ifndef DETLOGP_SERVER_TRANSPORT_GRPC_STATUS_H_
#define DETLOGP_SERVER_TRANSPORT_GRPC_STATUS_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace detlogp::server {

// With `context`, a status whose details say when to come back (RetryInfo)
// also sets gRPC's "grpc-retry-pushback-ms" trailer, which gRPC's own retry
// policy reads. Call it before Finish, on the call's context.
grpc::Status ToGrpcStatus(const absl::Status& status,
                          grpc::ServerContextBase* context = nullptr);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_GRPC_STATUS_H_
