// Reads a serialized LogProbRequest out of gRPC's received slices without
// copying hidden.data: every other field is parsed by protobuf, the rows are
// left where they arrived (a large request's rows are most of its bytes, and
// a copy of them would cost as much as receiving them).
#ifndef DETLOGP_SERVER_TRANSPORT_REQUEST_WIRE_H_
#define DETLOGP_SERVER_TRANSPORT_REQUEST_WIRE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::server {

struct SplitLogProbRequest {
  // The request less hidden.data.
  detlogp::v1::LogProbRequest header;
  // hidden.data's bytes, in order, inside the chunks given.
  std::vector<absl::string_view> data;
  int64_t data_bytes = 0;
};

// The request held by `chunks` (consecutive pieces of one message), split as
// above; nullopt when it is not in the one form read this way: exactly one
// hidden field holding exactly one data field, and every field well formed.
// The caller then parses the message whole, which gives any other form its
// meaning (protobuf merges repeated fields) and any malformed one its error.
std::optional<SplitLogProbRequest> SplitHiddenData(
    absl::Span<const absl::string_view> chunks);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_REQUEST_WIRE_H_
