// One ProjectResponse read straight from gRPC's receive buffers.
//
// A projection chunk is a few dozen bytes of header (request_id, row_offset,
// y's dtype and shape, the determinism key) around y.data: 5.5 MB at 256
// rows, 44 MB at 2048. Parsing it into a detlogp::v1::ProjectResponse copies
// y.data into a std::string (fresh pages for every chunk above glibc's mmap
// threshold), and the reading thread does not read the socket meanwhile.
// ParseProjectChunk instead walks the protobuf wire format of the received
// grpc::ByteBuffer, copies only the small fields, and leaves y.data where
// gRPC put it: `y_data` lists its pieces, in order, inside the buffer's
// slices (a received message is usually hundreds of slices, one per HTTP/2
// frame or socket read).
//
//   grpc::ByteBuffer message;                 // from a raw reader
//   absl::StatusOr<ProjectChunk> chunk = ParseProjectChunk(std::move(message));
//   for (absl::string_view piece : chunk->y_data) digest.Update(piece);
//   chunk->CopyYTo(destination);              // one copy, into the caller's
//   rows
//
// Any valid encoding of ProjectResponse parses (fields in any order, unknown
// fields skipped, shape packed or not, a repeated y merged as protobuf
// merges it). A malformed message is a DATA_LOSS status whose message starts
// with the field ("ProjectResponse.y.data: length 44040192 runs past the
// message's end ..."). The chunk is not checked against a request here
// (LogpClient::ProjectChunks does that).
#ifndef DETLOGP_CLIENT_PROJECT_CHUNK_H_
#define DETLOGP_CLIENT_PROJECT_CHUNK_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::client {

class ProjectChunk {
 public:
  ProjectChunk() = default;
  // Moves keep `y_data` valid (the slices stay where they are); copies would
  // not, so there are none.
  ProjectChunk(ProjectChunk&&) = default;
  ProjectChunk& operator=(ProjectChunk&&) = default;
  ProjectChunk(const ProjectChunk&) = delete;
  ProjectChunk& operator=(const ProjectChunk&) = delete;

  std::string request_id;
  int64_t row_offset = 0;
  detlogp::v1::DType y_dtype = detlogp::v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> y_shape;
  // y.data's bytes in order, pointing into `slices`: valid while this chunk
  // lives (moving it is fine).
  std::vector<absl::string_view> y_data;
  int64_t y_data_bytes = 0;
  std::string determinism_key;

  // Copies y.data, piece by piece, to `destination` (y_data_bytes bytes).
  void CopyYTo(void* destination) const;
  // The whole message as a ProjectResponse (a copy of y.data): for callers
  // that want the protobuf message.
  detlogp::v1::ProjectResponse ToProto() const;

  // The received message's slices (references, not copies): what y_data
  // points into.
  std::vector<grpc::Slice> slices;
};

// Parses `message` (a serialized ProjectResponse) without copying y.data.
absl::StatusOr<ProjectChunk> ParseProjectChunk(const grpc::ByteBuffer& message);

// The same over slices already taken from a message (moved into the chunk).
absl::StatusOr<ProjectChunk> ParseProjectChunk(std::vector<grpc::Slice> slices);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_PROJECT_CHUNK_H_
