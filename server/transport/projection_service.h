// ProjectionService: Y = X . W^T + b for MiniMax-H3 video inputs, streamed
// back in row order, a chunk of rows per message. A stream keeps at most two
// chunks in memory (one being written, one being computed), so a slow reader
// slows its own stream and never grows the server's memory.
#ifndef DETLOGP_SERVER_TRANSPORT_PROJECTION_SERVICE_H_
#define DETLOGP_SERVER_TRANSPORT_PROJECTION_SERVICE_H_

#include <functional>
#include <string>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "server/batching/projection_scheduler.h"
#include "server/transport/auth.h"

namespace detlogp::server {

class ProjectionServiceImpl final
    : public detlogp::v1::ProjectionService::CallbackService {
 public:
  struct Options {
    // Rows per response when the request leaves rows_per_chunk at 0.
    int64_t default_rows_per_chunk = 512;
    std::string determinism_key;
    // When set, every call must carry a known bearer token.
    const TokenAuthenticator* authenticator = nullptr;
    std::function<void(absl::string_view method, int grpc_code)> on_call_done;
  };

  // `scheduler` outlives the service.
  ProjectionServiceImpl(const Options& options, ProjectionScheduler* scheduler);

  grpc::ServerWriteReactor<detlogp::v1::ProjectResponse>* Project(
      grpc::CallbackServerContext* context,
      const detlogp::v1::ProjectRequest* request) override;

 private:
  class ProjectCall;

  const Options options_;
  ProjectionScheduler* const scheduler_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_PROJECTION_SERVICE_H_
