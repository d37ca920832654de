#include "server/transport/received_upload.h"

#include <utility>

#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"
#include "server/transport/upload_chunk_wire.h"
#include "server/transport/upload_forward_stream.h"

namespace detlogp::server {

using detlogp::v1::UploadModelRequest;

ReceivedUploadMessage ReadUploadMessage(grpc::ByteBuffer* received,
                                        bool forwarding) {
  ReceivedUploadMessage out;
  grpc::ByteBuffer bytes;
  bytes.Swap(received);
  auto chunk = std::make_shared<UploadChunkBytes>();
  if (!bytes.Valid() || !bytes.Dump(&chunk->slices).ok()) {
    out.status = absl::CancelledError("the call ended before the message");
    return out;
  }
  std::vector<absl::string_view> pieces;
  pieces.reserve(chunk->slices.size());
  for (const grpc::Slice& slice : chunk->slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()),
                        slice.size());
  }
  auto found = FindUploadChunk(pieces);
  if (!found.ok()) {
    out.status = found.status();
    if (forwarding) out.forward.Swap(&bytes);
    return out;
  }
  if (found->has_value()) {
    chunk->spans = std::move((*found)->spans);
    chunk->size = (*found)->size;
    out.part = UploadModelRequest::kChunk;
    out.chunk = std::move(chunk);
    if (forwarding) out.forward.Swap(&bytes);
    return out;
  }

  // Any other form: protobuf's parse (which consumes the buffer it reads).
  chunk->slices.clear();
  grpc::ByteBuffer whole(bytes);
  const grpc::Status parsed =
      grpc::SerializationTraits<UploadModelRequest>::Deserialize(&whole,
                                                                 &out.message);
  if (!parsed.ok()) {
    out.status = v1::FieldError(
        absl::StatusCode::kInvalidArgument, "UploadModelRequest",
        absl::StrCat("not a valid message (", parsed.error_message(), ")"));
    if (forwarding) out.forward.Swap(&bytes);
    return out;
  }
  out.part = out.message.part_case();
  if (out.part != UploadModelRequest::kChunk) {
    if (forwarding) out.forward = EncodeUploadMessage(out.message);
    return out;
  }
  chunk->parsed = std::move(*out.message.mutable_chunk());
  out.message.Clear();
  chunk->spans.emplace_back(chunk->parsed);
  chunk->size = static_cast<int64_t>(chunk->parsed.size());
  out.chunk = std::move(chunk);
  if (forwarding) {
    // The chunk written as protobuf would, over the same bytes.
    out.forward = EncodeUploadChunk(
        std::shared_ptr<const std::string>(out.chunk, &out.chunk->parsed));
  }
  return out;
}

}  // namespace detlogp::server
