#include "server/transport/grpc_status.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"

namespace detlogp::server {

grpc::Status ToGrpcStatus(const absl::Status& status,
                          grpc::ServerContextBase* context) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering (0..16).
  const int code = static_cast<int>(status.code());
  const grpc::StatusCode grpc_code = code >= 0 && code <= 16
                                         ? static_cast<grpc::StatusCode>(code)
                                         : grpc::StatusCode::UNKNOWN;
  if (context != nullptr) {
    const v1::ErrorDetails details = v1::DetailsOf(status);
    if (details.retry_delay.has_value()) {
      context->AddTrailingMetadata(
          "grpc-retry-pushback-ms",
          absl::StrCat(absl::ToInt64Milliseconds(*details.retry_delay)));
    }
  }
  return grpc::Status(grpc_code, std::string(status.message()),
                      v1::SerializeStatusDetails(status));
}

}  // namespace detlogp::server
