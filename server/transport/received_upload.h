// One UploadModel message as gRPC received it (the method is read raw): a
// plain chunk keeps its bytes where they arrived, shared by reference count
// between the local upload and the message a chain push forwards; any other
// message is parsed whole by protobuf (a header or a digest is small).
//
//   ReceivedUploadMessage message = ReadUploadMessage(&received, true);
//   if (message.status.ok() && message.part == UploadModelRequest::kChunk)
//     for (absl::string_view span : message.chunk->spans) Append(span);
//   next_server.Write(message.forward);
#ifndef DETLOGP_SERVER_TRANSPORT_RECEIVED_UPLOAD_H_
#define DETLOGP_SERVER_TRANSPORT_RECEIVED_UPLOAD_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::server {

// A chunk's bytes and what keeps them alive. Held by a shared pointer and
// never moved: a small slice keeps its bytes inside itself.
struct UploadChunkBytes {
  // The received message's slices (references, not copies), or the chunk of
  // a message protobuf parsed whole.
  std::vector<grpc::Slice> slices;
  std::string parsed;
  // The chunk's bytes, in order, inside the above.
  std::vector<absl::string_view> spans;
  int64_t size = 0;
};

struct ReceivedUploadMessage {
  // Not OK: the message is malformed (INVALID_ARGUMENT naming `chunk` for a
  // chunk's framing, `UploadModelRequest` for a message protobuf cannot
  // parse), or there was none (CANCELLED).
  absl::Status status;
  detlogp::v1::UploadModelRequest::PartCase part =
      detlogp::v1::UploadModelRequest::PART_NOT_SET;
  // part == kChunk: the chunk's bytes.
  std::shared_ptr<const UploadChunkBytes> chunk;
  // Any other part: the message.
  detlogp::v1::UploadModelRequest message;
  // With `forwarding`: the wire bytes a typed forward of the message sends;
  // for a plain chunk, and for a malformed message (the next server refuses
  // it for itself), the received buffer itself.
  grpc::ByteBuffer forward;
};

// Takes the message out of `received`, which is left empty for the next
// read.
ReceivedUploadMessage ReadUploadMessage(grpc::ByteBuffer* received,
                                        bool forwarding);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_RECEIVED_UPLOAD_H_
