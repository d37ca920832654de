#include "server/transport/grpc_status.h"

#include <string>

namespace detlogp::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering (0..16).
  const int code = static_cast<int>(status.code());
  const grpc::StatusCode grpc_code = code >= 0 && code <= 16
                                         ? static_cast<grpc::StatusCode>(code)
                                         : grpc::StatusCode::UNKNOWN;
  return grpc::Status(grpc_code, std::string(status.message()));
}

}  // namespace detlogp::server
