// A request's wire bytes in one buffer of gRPC's, written once.
#ifndef DETLOGP_CLIENT_REQUEST_BYTES_H_
#define DETLOGP_CLIENT_REQUEST_BYTES_H_

#include <grpcpp/support/byte_buffer.h>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::client {

// The wire bytes of `header` with `rows` as hidden.data, in one buffer of
// gRPC's: the rows are copied once, straight into it (no protobuf message
// holds them). `header`'s own hidden.data and hidden.shared_memory are left
// out. The bytes parse as `header` with hidden.data = rows.
grpc::ByteBuffer SerializeWithRows(const detlogp::v1::LogProbRequest& header,
                                   absl::string_view rows);

// `request` as it is (rows in its data, or named by reference).
grpc::ByteBuffer SerializeRequest(const detlogp::v1::LogProbRequest& request);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_REQUEST_BYTES_H_
