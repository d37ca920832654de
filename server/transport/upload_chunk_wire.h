// Finds the chunk of a serialized UploadModelRequest where gRPC received
// it: the message's framing (the `chunk` field's tag and length) is read by
// hand and the chunk's bytes are left in the received pieces, so a chain
// replica copies them once, into the new weights, and forwards the message
// as it arrived.
#ifndef DETLOGP_SERVER_TRANSPORT_UPLOAD_CHUNK_WIRE_H_
#define DETLOGP_SERVER_TRANSPORT_UPLOAD_CHUNK_WIRE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace detlogp::server {

struct UploadChunkSpans {
  // The chunk's bytes, in order, inside the pieces given (no empty spans).
  std::vector<absl::string_view> spans;
  int64_t size = 0;
};

// The chunk of the message held by `pieces` (consecutive pieces of one
// serialized UploadModelRequest) when the message is exactly one `chunk`
// field framed as protobuf writes it: its tag, its length as the shortest
// varint, its bytes. Such a message's bytes are the ones a typed forward of
// it would send.
//
// nullopt for any other form (a header, a digest, a chunk followed by other
// fields, a length written with padding bytes): the caller parses it whole,
// which gives it protobuf's meaning. INVALID_ARGUMENT naming `chunk` when
// the chunk's length is malformed: over 10 bytes, cut off by the message's
// end, or more than the bytes that follow.
absl::StatusOr<std::optional<UploadChunkSpans>> FindUploadChunk(
    absl::Span<const absl::string_view> pieces);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_UPLOAD_CHUNK_WIRE_H_
