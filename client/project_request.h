// The wire bytes of one Project call's request, with X's rows lent to gRPC
// in place: a few dozen bytes of header (request_id, rows_per_chunk, x's
// dtype, shape and the data field's key and length) in a slice of their
// own, then one slice per block of rows pointing into the caller's X.
//
// Building a detlogp::v1::ProjectRequest instead copies X twice before a
// byte leaves (into x.data's std::string, then into the serialised
// message): 280 MB of fresh memory and two passes over it for a 364,608-row
// video, all before the server can start (docs/perf.md, session 15). The
// bytes parse as the same ProjectRequest (fields in another order, which
// protobuf accepts).
//
// The slices do not own X: the caller keeps it alive and unchanged until
// the call's Finish has returned (LogpClient::ProjectChunks does: every
// call ends before it returns).
#ifndef DETLOGP_CLIENT_PROJECT_REQUEST_H_
#define DETLOGP_CLIENT_PROJECT_REQUEST_H_

#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace detlogp::client {

// One contiguous run of a call's rows: `rows` rows of 96 floats at `x`.
struct RowSpan {
  const float* x;
  int64_t rows;
};

// A ProjectRequest of the spans' rows, in order, as one float32 [R, 96]
// tensor.
grpc::ByteBuffer ProjectRequestBytes(const std::vector<RowSpan>& spans,
                                     int64_t rows_per_chunk,
                                     const std::string& request_id);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_PROJECT_REQUEST_H_
