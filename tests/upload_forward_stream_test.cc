// The wire bytes a chain push forwards: a chunk encoded around its shared
// bytes parses as the message protobuf would have written, and its bytes
// stay alive exactly as long as a buffer refers to them.
#include "server/transport/upload_forward_stream.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/slice.h>

#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::server {
namespace {

using detlogp::v1::UploadModelRequest;

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return bytes;
}

std::string Pattern(size_t size) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i * 131 + 7);
  return bytes;
}

TEST(UploadForwardStreamTest, ChunkEncodesAsProtobufWouldAndSharesItsBytes) {
  // Sizes around the varint length's byte boundaries, and a 4 MiB chunk.
  for (size_t size : {size_t{0}, size_t{1}, size_t{127}, size_t{128},
                      size_t{16383}, size_t{16384}, size_t{4} << 20}) {
    auto chunk = std::make_shared<const std::string>(Pattern(size));
    const char* data = chunk->data();
    grpc::ByteBuffer encoded = EncodeUploadChunk(chunk);
    // The buffer's slice points at the chunk itself: no copy was made.
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(encoded.Dump(&slices).ok());
    ASSERT_EQ(slices.size(), 2u) << size;
    EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), data);
    slices.clear();
    EXPECT_EQ(chunk.use_count(), 2) << size;

    UploadModelRequest expected;
    expected.set_chunk(*chunk);
    const std::string wire = Flatten(encoded);
    EXPECT_EQ(wire, expected.SerializeAsString()) << size;
    UploadModelRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(wire)) << size;
    ASSERT_EQ(parsed.part_case(), UploadModelRequest::kChunk);
    EXPECT_EQ(parsed.chunk(), *chunk) << size;

    // A copy of the buffer shares it too; the chunk is released with the
    // last buffer.
    grpc::ByteBuffer copy = encoded;
    encoded.Clear();
    EXPECT_EQ(chunk.use_count(), 2) << size;
    copy.Clear();
    EXPECT_EQ(chunk.use_count(), 1) << size;
  }
}

TEST(UploadForwardStreamTest, OtherMessagesEncodeAsTheirSerialization) {
  UploadModelRequest header;
  header.mutable_header()->set_model("policy");
  header.mutable_header()->add_forward_to("127.0.0.1:1");
  header.mutable_header()->set_forwarded(true);
  UploadModelRequest trailer;
  trailer.set_weights_sha256(std::string(64, 'a'));
  for (const UploadModelRequest* message : {&header, &trailer}) {
    EXPECT_EQ(Flatten(EncodeUploadMessage(*message)),
              message->SerializeAsString());
  }
}

}  // namespace
}  // namespace detlogp::server
