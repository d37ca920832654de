// LogProbService over gRPC's callback API. Calls never block a gRPC thread:
// a request picks its model version (ModelManager), is validated against
// that version's shapes, handed to the DynamicBatcher, and its reactor is
// finished from the batch thread that completes its last row. The request
// holds the version until it is answered.
#ifndef DETLOGP_SERVER_TRANSPORT_LOGPROB_SERVICE_H_
#define DETLOGP_SERVER_TRANSPORT_LOGPROB_SERVICE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "server/batching/batcher.h"
#include "server/models/model_manager.h"
#include "server/shared_memory/region_registry.h"
#include "server/transport/auth.h"
#include "server/transport/request_validation.h"

namespace detlogp::server {

// ComputeLogProbs and StreamLogProbs take their requests as gRPC's received
// bytes: the rows are read from them where they arrived (request_wire.h),
// never copied into a message first.
class LogProbServiceImpl final
    : public detlogp::v1::LogProbService::WithRawCallbackMethod_StreamLogProbs<
          detlogp::v1::LogProbService::WithRawCallbackMethod_ComputeLogProbs<
              detlogp::v1::LogProbService::WithCallbackMethod_GetModelInfo<
                  detlogp::v1::LogProbService::Service>>> {
 public:
  struct Options {
    int64_t max_request_rows = 65536;
    // Largest top_k a request may ask for (<= kernels::kMaxTopK).
    int64_t max_top_k = 20;
    // Non-empty: the backend computes no entropy or top-k, and why
    // (requests asking for them get FAILED_PRECONDITION).
    std::string extras_unavailable;
    // Requests read ahead on one stream before their answers are written;
    // reading stops (backpressure) beyond it.
    int max_stream_inflight_requests = 64;
    // When set, every call must carry a known bearer token.
    const TokenAuthenticator* authenticator = nullptr;
    // Called once per finished call with the method name and gRPC code.
    std::function<void(absl::string_view method, int grpc_code)> on_call_done;
    // Called once per computed request with its model and row count.
    std::function<void(absl::string_view model, int64_t rows)> on_rows_answered;
    // Called once per scheduled request with how its hidden bytes arrived
    // ("grpc", "system_shm", "cuda_shm") and how many.
    std::function<void(absl::string_view path, int64_t bytes)> on_hidden_bytes;
    // Regions requests may name in hidden.shared_memory (callers on this
    // host only); null: such requests get FAILED_PRECONDITION.
    SharedMemoryRegistry* shared_memory = nullptr;
    // Reported in ModelInfo so clients cut larger calls themselves.
    int64_t max_receive_message_bytes = 0;
    // Decides whether a peer string is on this host (tests replace it).
    std::function<bool(absl::string_view peer)> is_same_host;
  };

  // Who is calling, for shared-memory references.
  struct Caller {
    std::string token;  // the bearer token presented ("" without)
    bool same_host = false;
  };

  // `models` and `batcher` outlive the service.
  LogProbServiceImpl(const Options& options, const ModelManager* models,
                     DynamicBatcher* batcher);

  grpc::ServerUnaryReactor* ComputeLogProbs(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response) override;

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StreamLogProbs(
      grpc::CallbackServerContext* context) override;

  grpc::ServerUnaryReactor* GetModelInfo(
      grpc::CallbackServerContext* context,
      const detlogp::v1::GetModelInfoRequest* request,
      detlogp::v1::ModelInfo* response) override;

  // Validates `request` and schedules its rows; on success `done` runs once
  // with the job's status and the filled response. The job may borrow the
  // request's bytes: `request_owner` (or the caller) keeps them alive until
  // `done` runs. `message_rows`: hidden.data's bytes in pieces when the
  // request carries none itself (kept alive the same way).
  absl::Status Submit(
      const detlogp::v1::LogProbRequest& request, const Caller& caller,
      std::shared_ptr<const void> request_owner, absl::Time deadline,
      detlogp::v1::LogProbResponse* response,
      absl::AnyInvocable<void(absl::Status)> done,
      std::shared_ptr<LogpJob>* job,
      const std::vector<absl::string_view>* message_rows = nullptr);

 private:
  class UnaryCall;
  class StreamCall;

  grpc::Status Record(absl::string_view method, grpc::Status status) const;
  // OK, or the UNAUTHENTICATED status to finish the call with.
  grpc::Status Authenticate(const grpc::CallbackServerContext& context) const;
  Caller CallerOf(const grpc::CallbackServerContext& context) const;

  const Options options_;
  const ModelManager* const models_;
  DynamicBatcher* const batcher_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_LOGPROB_SERVICE_H_
