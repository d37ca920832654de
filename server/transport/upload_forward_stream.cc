#include "server/transport/upload_forward_stream.h"

#include <utility>

#include <grpcpp/support/proto_buffer_reader.h>

#include "proto/wire_format.h"

namespace detlogp::server {
namespace {

void ReleaseChunk(void* ref) {
  delete static_cast<std::shared_ptr<const std::string>*>(ref);
}

}  // namespace

grpc::ByteBuffer EncodeUploadMessage(
    const detlogp::v1::UploadModelRequest& message) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer EncodeUploadChunk(std::shared_ptr<const std::string> chunk) {
  std::string head;
  v1::wire::AppendVarint(
      v1::wire::Tag(detlogp::v1::UploadModelRequest::kChunkFieldNumber,
                    v1::wire::kLengthDelimited),
      &head);
  v1::wire::AppendVarint(chunk->size(), &head);
  // gRPC never writes through the slice; its constructor takes a void*.
  char* data = const_cast<char*>(chunk->data());
  const size_t size = chunk->size();
  grpc::Slice slices[2] = {
      grpc::Slice(head),
      grpc::Slice(data, size, &ReleaseChunk,
                  new std::shared_ptr<const std::string>(std::move(chunk)))};
  return grpc::ByteBuffer(slices, 2);
}

UploadForwardStream::UploadForwardStream(
    const std::shared_ptr<grpc::Channel>& channel,
    grpc::ClientContext* context) {
  grpc::GenericStub stub(channel);
  call_ = stub.PrepareCall(context, method_, &queue_);
  call_->StartCall(this);
  open_ = Wait();
}

UploadForwardStream::~UploadForwardStream() {
  queue_.Shutdown();
  void* tag;
  bool ok;
  while (queue_.Next(&tag, &ok)) {
  }
}

bool UploadForwardStream::Write(const grpc::ByteBuffer& message) {
  if (!open_) return false;
  call_->Write(message, this);
  open_ = Wait();
  return open_;
}

bool UploadForwardStream::WritesDone() {
  if (!open_) return false;
  call_->WritesDone(this);
  open_ = Wait();
  return open_;
}

grpc::Status UploadForwardStream::Finish(
    detlogp::v1::ModelVersionStatus* response) {
  // A client-streaming call's one response comes before its status; a
  // failed call has none and the read fails.
  grpc::ByteBuffer answer;
  call_->Read(&answer, this);
  const bool answered = Wait();
  grpc::Status status;
  call_->Finish(&status, this);
  Wait();
  if (status.ok()) {
    if (!answered || !answer.Valid()) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          "the next server answered OK without a response");
    }
    grpc::Status parsed =
        grpc::SerializationTraits<detlogp::v1::ModelVersionStatus>::Deserialize(
            &answer, response);
    if (!parsed.ok()) return parsed;
  }
  return status;
}

bool UploadForwardStream::Wait() {
  void* tag = nullptr;
  bool ok = false;
  if (!queue_.Next(&tag, &ok)) return false;
  return ok;
}

}  // namespace detlogp::server
