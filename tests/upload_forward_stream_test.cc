// The wire bytes a chain push forwards: a chunk encoded around its shared
// bytes parses as the message protobuf would have written, and its bytes
// stay alive exactly as long as a buffer refers to them; the stream
// delivers them to a server, and ends with its refusal or a cancel.
#include "server/transport/upload_forward_stream.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/slice.h>

#include "detlogp/v1/detlogp.grpc.pb.h"
#include "tests/upload_wire_bytes.h"

namespace detlogp::server {
namespace {

using detlogp::v1::ModelVersionStatus;
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

// The next server, in process: reads the stream (or refuses it after the
// header) and answers version 7.
class NextServer final : public detlogp::v1::ModelRepositoryService::Service {
 public:
  explicit NextServer(bool refuse_after_header)
      : refuse_after_header_(refuse_after_header) {}

  grpc::Status UploadModel(grpc::ServerContext* /*context*/,
                           grpc::ServerReader<UploadModelRequest>* reader,
                           ModelVersionStatus* response) override {
    UploadModelRequest message;
    while (reader->Read(&message)) {
      received_.push_back(message);
      if (refuse_after_header_) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "refused");
      }
    }
    response->set_version(7);
    return grpc::Status::OK;
  }

  const std::vector<UploadModelRequest>& received() const { return received_; }

 private:
  const bool refuse_after_header_;
  std::vector<UploadModelRequest> received_;  // read by the test after Finish
};

class Started {
 public:
  explicit Started(NextServer* service) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
  }
  ~Started() { server_->Shutdown(); }
  std::shared_ptr<grpc::Channel> Channel() const {
    return grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                               grpc::InsecureChannelCredentials());
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

UploadModelRequest Header() {
  UploadModelRequest message;
  message.mutable_header()->set_model("policy");
  message.mutable_header()->set_forwarded(true);
  return message;
}

TEST(UploadForwardStreamTest, TheNextServerReadsEveryMessageAsSent) {
  NextServer next(/*refuse_after_header=*/false);
  Started server(&next);
  grpc::ClientContext context;
  ModelVersionStatus response;
  std::vector<std::shared_ptr<const std::string>> chunks;
  for (size_t size : {size_t{1000}, size_t{0}, size_t{3} << 20}) {
    chunks.push_back(std::make_shared<const std::string>(Pattern(size)));
  }
  UploadModelRequest trailer;
  trailer.set_weights_sha256(std::string(64, 'b'));
  {
    UploadForwardStream stream(server.Channel(), &context);
    ASSERT_TRUE(stream.Write(EncodeUploadMessage(Header())));
    for (const auto& chunk : chunks)
      ASSERT_TRUE(stream.Write(EncodeUploadChunk(chunk)));
    ASSERT_TRUE(stream.Write(EncodeUploadMessage(trailer)));
    ASSERT_TRUE(stream.WritesDone());
    const grpc::Status status = stream.Finish(&response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(response.version(), 7);
  const std::vector<UploadModelRequest>& received = next.received();
  ASSERT_EQ(received.size(), 5u);
  EXPECT_EQ(received[0].SerializeAsString(), Header().SerializeAsString());
  for (size_t i = 0; i < chunks.size(); ++i) {
    ASSERT_EQ(received[i + 1].part_case(), UploadModelRequest::kChunk);
    EXPECT_EQ(received[i + 1].chunk(), *chunks[i]) << i;
  }
  EXPECT_EQ(received[4].weights_sha256(), trailer.weights_sha256());
  // gRPC has released every chunk.
  for (const auto& chunk : chunks) EXPECT_EQ(chunk.use_count(), 1);
}

TEST(UploadForwardStreamTest, ARefusalEndsTheWritesAndIsTheStatus) {
  NextServer next(/*refuse_after_header=*/true);
  Started server(&next);
  grpc::ClientContext context;
  UploadForwardStream stream(server.Channel(), &context);
  ASSERT_TRUE(stream.Write(EncodeUploadMessage(Header())));
  // 64 MiB, more than gRPC's windows hold: the writes fail once the
  // refusal arrives, and each after that fails at once.
  auto chunk = std::make_shared<const std::string>(Pattern(size_t{1} << 20));
  int failed = 0;
  for (int i = 0; i < 64; ++i) {
    if (!stream.Write(EncodeUploadChunk(chunk))) ++failed;
  }
  EXPECT_GT(failed, 0);
  EXPECT_FALSE(stream.WritesDone());
  ModelVersionStatus response;
  const grpc::Status status = stream.Finish(&response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(), "refused");
}

TEST(UploadForwardStreamTest, ACancelledCallFinishesCancelled) {
  NextServer next(/*refuse_after_header=*/false);
  Started server(&next);
  grpc::ClientContext context;
  UploadForwardStream stream(server.Channel(), &context);
  ASSERT_TRUE(stream.Write(EncodeUploadMessage(Header())));
  context.TryCancel();
  ModelVersionStatus response;
  EXPECT_EQ(stream.Finish(&response).error_code(), grpc::StatusCode::CANCELLED);
}

}  // namespace
}  // namespace detlogp::server
