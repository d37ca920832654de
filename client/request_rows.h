// Fields of a LogProbRequest the client's cutting and regions read: a
// row's bytes, and the request without its rows.
#ifndef DETLOGP_CLIENT_REQUEST_ROWS_H_
#define DETLOGP_CLIENT_REQUEST_ROWS_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::client {

// Bytes of one row of `request`'s hidden tensor; 0 when its shape or dtype
// is not one the server accepts (the request then goes as it is, and the
// server names the field).
int64_t RowBytes(const detlogp::v1::LogProbRequest& request);

// Every field of `request` but the hidden tensor's bytes or reference.
detlogp::v1::LogProbRequest WithoutHiddenBytes(
    const detlogp::v1::LogProbRequest& request);

// Every field of `request` but the hidden tensor's shape, bytes or
// reference and the targets: what each request a call is cut into repeats.
detlogp::v1::LogProbRequest WithoutRows(
    const detlogp::v1::LogProbRequest& request);

// A request with its rows in the message, cut into slices of
// `rows_per_request` rows: each slice's fields but its rows (headers), and
// its rows in the request's bytes. The request's bytes must fill its shape.
struct RowSlices {
  std::vector<detlogp::v1::LogProbRequest> headers;
  std::vector<absl::string_view> rows;
};
RowSlices CutRows(const detlogp::v1::LogProbRequest& request,
                  int64_t rows_per_request, absl::string_view bytes);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_REQUEST_ROWS_H_
