// ReadUploadMessage: a plain chunk's bytes stay in the slices gRPC received
// (no copy) and the received buffer itself is what a chain forwards; every
// other message is parsed whole and forwarded as a typed forward writes it;
// a malformed message is refused naming its field and forwarded as it came.
#include "server/transport/received_upload.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.pb.h"
#include "proto/status_details.h"
#include "server/transport/upload_forward_stream.h"
#include "tests/upload_wire_bytes.h"

namespace detlogp::server {
namespace {

using detlogp::v1::UploadModelRequest;

std::vector<grpc::Slice> SlicesOf(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  return slices;
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::string bytes;
  for (const grpc::Slice& slice : SlicesOf(buffer)) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return bytes;
}

// `wire` in a buffer of slices cut at `cuts`, as gRPC hands a message over.
grpc::ByteBuffer Received(const std::string& wire,
                          const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(wire.data() + from, cut - from);
    from = cut;
  }
  slices.emplace_back(wire.data() + from, wire.size() - from);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Join(const UploadChunkBytes& chunk) {
  std::string joined;
  for (absl::string_view span : chunk.spans)
    joined.append(span.data(), span.size());
  return joined;
}

TEST(ReceivedUploadTest, APlainChunkStaysInTheReceivedSlices) {
  const std::string chunk = Pattern(5000);
  const std::string wire = ChunkMessage(chunk);
  // Cuts inside the length, and in the bytes.
  grpc::ByteBuffer received = Received(wire, {2, 1000, 3000});
  const std::vector<grpc::Slice> original = SlicesOf(received);

  ReceivedUploadMessage message =
      ReadUploadMessage(&received, /*forwarding=*/true);
  ASSERT_TRUE(message.status.ok()) << message.status;
  EXPECT_FALSE(received.Valid());  // taken, ready for the next read
  ASSERT_EQ(message.part, UploadModelRequest::kChunk);
  EXPECT_EQ(message.chunk->size, 5000);
  EXPECT_EQ(Join(*message.chunk), chunk);
  EXPECT_TRUE(message.chunk->parsed.empty());
  // The large spans point into the received slices (small slices keep
  // their bytes inline, so only those are compared).
  ASSERT_EQ(message.chunk->spans.size(), 3u);
  EXPECT_EQ(message.chunk->spans[1].data(),
            reinterpret_cast<const char*>(original[2].begin()));
  EXPECT_EQ(message.chunk->spans[2].data(),
            reinterpret_cast<const char*>(original[3].begin()));

  // The forward is the received buffer: the same slices, the bytes a typed
  // forward sends.
  EXPECT_EQ(Flatten(message.forward), wire);
  const std::vector<grpc::Slice> forwarded = SlicesOf(message.forward);
  ASSERT_EQ(forwarded.size(), original.size());
  for (size_t i = 0; i < original.size(); ++i) {
    if (original[i].size() > 64) {
      EXPECT_EQ(forwarded[i].begin(), original[i].begin()) << i;
    }
  }
}

void CountRelease(void* count) { ++*static_cast<int*>(count); }

TEST(ReceivedUploadTest, TheBytesLiveUntilTheLastHolderLetsGo) {
  std::string wire = ChunkMessage(Pattern(4096));
  int released = 0;
  grpc::ByteBuffer received;
  {
    grpc::Slice slice(wire.data(), wire.size(), &CountRelease, &released);
    received = grpc::ByteBuffer(&slice, 1);
  }
  ReceivedUploadMessage message = ReadUploadMessage(&received, true);
  ASSERT_EQ(message.part, UploadModelRequest::kChunk);
  message.forward.Clear();  // gRPC sent it
  EXPECT_EQ(released, 0);
  EXPECT_EQ(Join(*message.chunk), Pattern(4096));
  message.chunk.reset();  // the local upload copied it
  EXPECT_EQ(released, 1);
}

TEST(ReceivedUploadTest, WithoutForwardingThereIsNoForward) {
  grpc::ByteBuffer received = Received(ChunkMessage("abc"), {});
  ReceivedUploadMessage message = ReadUploadMessage(&received, false);
  ASSERT_EQ(message.part, UploadModelRequest::kChunk);
  EXPECT_EQ(Join(*message.chunk), "abc");
  EXPECT_FALSE(message.forward.Valid());
}

TEST(ReceivedUploadTest, OtherMessagesAreParsedAndForwardedAsTyped) {
  UploadModelRequest header;
  header.mutable_header()->set_model("policy");
  header.mutable_header()->add_shape(16);
  header.mutable_header()->add_shape(8);
  grpc::ByteBuffer received = Received(header.SerializeAsString(), {3});
  ReceivedUploadMessage message = ReadUploadMessage(&received, true);
  ASSERT_TRUE(message.status.ok()) << message.status;
  ASSERT_EQ(message.part, UploadModelRequest::kHeader);
  EXPECT_EQ(message.message.header().model(), "policy");
  EXPECT_EQ(message.chunk, nullptr);
  EXPECT_EQ(Flatten(message.forward),
            Flatten(EncodeUploadMessage(message.message)));

  UploadModelRequest digest;
  digest.set_weights_sha256(std::string(64, 'c'));
  received = Received(digest.SerializeAsString(), {});
  message = ReadUploadMessage(&received, true);
  ASSERT_EQ(message.part, UploadModelRequest::kWeightsSha256);
  EXPECT_EQ(message.message.weights_sha256(), std::string(64, 'c'));
  EXPECT_EQ(Flatten(message.forward), digest.SerializeAsString());
}

TEST(ReceivedUploadTest, AChunkInAnotherFormIsForwardedAsTyped) {
  // A chunk with an unknown field after it, and one with a padded length:
  // protobuf reads the chunk; the forward is the chunk alone, as a typed
  // forward writes it.
  const std::string chunk = Pattern(200);
  for (const std::string& wire :
       {ChunkMessage(chunk) + std::string("\x78\x01", 2),
        std::string("\x12\xc8\x81\x00", 4) + chunk}) {
    grpc::ByteBuffer received = Received(wire, {1});
    ReceivedUploadMessage message = ReadUploadMessage(&received, true);
    ASSERT_TRUE(message.status.ok()) << message.status;
    ASSERT_EQ(message.part, UploadModelRequest::kChunk);
    EXPECT_EQ(Join(*message.chunk), chunk);
    EXPECT_EQ(message.chunk->size, 200);
    EXPECT_EQ(Flatten(message.forward), ChunkMessage(chunk));
  }
}

TEST(ReceivedUploadTest, MalformedMessagesAreRefusedAndForwardedAsTheyCame) {
  struct Case {
    std::string wire;
    std::string field;
  };
  for (const Case& c : {Case{std::string("\x12\x05"
                                         "abc",
                                         5),
                             "chunk"},
                        Case{std::string("\x12\x80", 2), "chunk"},
                        // A header cut short.
                        Case{std::string("\x0a\x05"
                                         "ab",
                                         4),
                             "UploadModelRequest"}}) {
    grpc::ByteBuffer received = Received(c.wire, {1});
    ReceivedUploadMessage message = ReadUploadMessage(&received, true);
    EXPECT_EQ(message.status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(v1::DetailsOf(message.status).fields,
              std::vector<std::string>{c.field});
    EXPECT_EQ(Flatten(message.forward), c.wire);
  }
}

TEST(ReceivedUploadTest, NoMessageIsCancelled) {
  grpc::ByteBuffer none;
  EXPECT_EQ(ReadUploadMessage(&none, true).status.code(),
            absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace detlogp::server
