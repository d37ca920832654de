// The outgoing UploadModel call of a chain push: the messages a server
// received go on to the next server as wire bytes, so a chunk is neither
// copied into a new message nor serialized again. A plain chunk goes on as
// the buffer it arrived in (server/transport/received_upload.h); a chunk
// protobuf parsed goes as a small field header before its bytes, shared (a
// reference count) between the local upload and gRPC's send buffer.
//
//   UploadForwardStream stream(channel, &context);
//   stream.Write(EncodeUploadMessage(header_message));
//   stream.Write(received_chunk_buffer);   // as chunks arrive
//   ...
//   stream.WritesDone();
//   grpc::Status status = stream.Finish(&response);
//
// One operation is outstanding at a time, each waited for on the calling
// thread through a completion queue of the stream's own (gRPC's public
// generic API), so Write blocks under flow control like a sync writer's.
#ifndef DETLOGP_SERVER_TRANSPORT_UPLOAD_FORWARD_STREAM_H_
#define DETLOGP_SERVER_TRANSPORT_UPLOAD_FORWARD_STREAM_H_

#include <memory>
#include <string>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

#include "detlogp/v1/detlogp.grpc.pb.h"

namespace detlogp::server {

// An UploadModelRequest's wire bytes (any part; serialized).
grpc::ByteBuffer EncodeUploadMessage(
    const detlogp::v1::UploadModelRequest& message);

// The wire bytes of an UploadModelRequest whose part is `chunk`: a few
// bytes of field tag and length, then a slice over `chunk` itself, which
// it keeps alive until gRPC has sent it.
grpc::ByteBuffer EncodeUploadChunk(std::shared_ptr<const std::string> chunk);

class UploadForwardStream {
 public:
  // Starts the call; `context` (deadline, metadata set) outlives the
  // stream.
  UploadForwardStream(const std::shared_ptr<grpc::Channel>& channel,
                      grpc::ClientContext* context);
  UploadForwardStream(const UploadForwardStream&) = delete;
  UploadForwardStream& operator=(const UploadForwardStream&) = delete;
  ~UploadForwardStream();

  // Sends one message; false once the stream is broken (the server stopped
  // reading or the call ended): later writes are refused at once.
  bool Write(const grpc::ByteBuffer& message);
  // Half-closes the stream; false when it was already broken.
  bool WritesDone();
  // The call's status, and on OK its response. Once, after the writes (or
  // after the context was cancelled).
  grpc::Status Finish(detlogp::v1::ModelVersionStatus* response);

 private:
  // The operation just started: whether it succeeded.
  bool Wait();

  // gRPC keeps a pointer to the method's name for the call's life.
  const std::string method_ = "/detlogp.v1.ModelRepositoryService/UploadModel";
  grpc::CompletionQueue queue_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool open_ = false;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_UPLOAD_FORWARD_STREAM_H_
