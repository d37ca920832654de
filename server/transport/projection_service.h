// ProjectionService: Y = X . W^T + b for MiniMax-H3 video inputs, streamed
// back in row order, a chunk of rows per message.
//
// A stream keeps a ring of chunk buffers: while one chunk is written, the
// next ones are computed into the others. Their number is bounded by
// Options::max_stream_buffer_bytes (two chunks at least), so a slow reader
// slows its own stream and never grows the server's memory.
//
// Responses go out as ready-made wire bytes (the method is registered raw):
// a small protobuf header, then the chunk's buffer itself as the `y.data`
// bytes, then the determinism key. The executor writes Y straight into that
// buffer and gRPC sends it from there, so a chunk is never serialised or
// copied into a message; clients parse the same ProjectResponse as before.
// The buffers come from the projection backend's HostBufferPool (pinned
// memory on CUDA, which the device copies Y into directly).
#ifndef DETLOGP_SERVER_TRANSPORT_PROJECTION_SERVICE_H_
#define DETLOGP_SERVER_TRANSPORT_PROJECTION_SERVICE_H_

#include <grpcpp/support/byte_buffer.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "server/backends/host_buffer_pool.h"
#include "server/batching/projection_scheduler.h"
#include "server/transport/auth.h"

namespace detlogp::server {

class ProjectionServiceImpl final
    : public detlogp::v1::ProjectionService::WithRawCallbackMethod_Project<
          detlogp::v1::ProjectionService::Service> {
 public:
  // Where one stream's time went, reported once per stream when it ends.
  struct StreamTimings {
    int64_t chunks = 0;                     // chunks written
    double write_seconds = 0;               // StartWrite until OnWriteDone
    double waited_for_compute_seconds = 0;  // no write: next chunk not ready
    int64_t most_chunks_buffered = 0;       // chunks held at once
    int64_t buffers_allocated = 0;          // chunk buffers allocated
  };

  struct Options {
    // Rows per response when the request leaves rows_per_chunk at 0.
    int64_t default_rows_per_chunk = 512;
    // Output bytes one stream may hold in its chunk buffers (computed and
    // waiting, or being written); at least two chunks whatever the value.
    // gRPC writes one message of a stream at a time, so buffers beyond two
    // only absorb the scheduler's latency (other streams' launches queued
    // ahead): 64 MiB is five 512-row chunks (11 MB each) or two of the
    // largest (2048 rows, 44 MB).
    int64_t max_stream_buffer_bytes = int64_t{64} << 20;
    std::string determinism_key;
    // When set, every call must carry a known bearer token.
    const TokenAuthenticator* authenticator = nullptr;
    std::function<void(absl::string_view method, int grpc_code)> on_call_done;
    // Called once per stream that got past validation, when it is done
    // (the server's metrics; tests and the benchmark).
    std::function<void(const StreamTimings&)> on_stream_timings;
    // Where chunk buffers come from: the projection backend's
    // host_buffer_pool(); null is plain heap memory.
    std::shared_ptr<HostBufferPool> chunk_buffers;
  };

  // `scheduler` outlives the service.
  ProjectionServiceImpl(const Options& options, ProjectionScheduler* scheduler);

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Project(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;

  // What the chunk buffers' pool has done (the server's metrics).
  HostBufferPool::Stats chunk_buffer_stats() const {
    return chunk_buffers_->stats();
  }

 private:
  class ProjectCall;

  const Options options_;
  ProjectionScheduler* const scheduler_;
  const std::shared_ptr<HostBufferPool> chunk_buffers_;  // never null
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_PROJECTION_SERVICE_H_
