// ModelRepositoryService over gRPC's callback API: lists, loads, uploads and
// unloads lm_head model versions while the server answers requests.
//
// Every call needs an admin token (--admin_tokens_file; scoring tokens are
// not enough). With no admin tokens configured, calls are refused unless the
// server listens on loopback only.
//
// Loads and uploads never block a gRPC thread: their work (reading a file,
// hashing and writing uploaded bytes, placing the weights on the devices,
// the warm-up) runs on threads of the service's own.
#ifndef DETLOGP_SERVER_TRANSPORT_MODEL_REPOSITORY_SERVICE_H_
#define DETLOGP_SERVER_TRANSPORT_MODEL_REPOSITORY_SERVICE_H_

#include <functional>
#include <memory>

#include <grpcpp/security/credentials.h>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "server/models/model_manager.h"
#include "server/models/model_store.h"
#include "server/transport/auth.h"
#include "server/transport/background_tasks.h"

namespace detlogp::server {

// UploadModel is read raw (server/transport/received_upload.h): a chunk's
// bytes are copied once, from where they arrived into the new weights.
class ModelRepositoryServiceImpl final
    : public detlogp::v1::ModelRepositoryService::
          WithRawCallbackMethod_UploadModel<
              detlogp::v1::ModelRepositoryService::CallbackService> {
 public:
  struct Options {
    // Accepted admin tokens; null means none are configured.
    const TokenAuthenticator* admin_authenticator = nullptr;
    // Without admin tokens: allow calls (true only when the server listens
    // on loopback only).
    bool allow_without_admin_token = false;
    // --model_root; null: LoadModel is refused and uploads are not kept on
    // disk.
    ModelStore* store = nullptr;
    // Uploaded chunks waiting to be hashed and written, per upload, before
    // reading pauses (backpressure).
    int max_pending_upload_chunks = 8;
    // How this server reaches the next server of a chain push; null:
    // plaintext.
    std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
    // DownloadModel's chunk size.
    int64_t download_chunk_bytes = int64_t{4} << 20;
    std::function<void(absl::string_view method, int grpc_code)> on_call_done;
    // Upload bytes as they arrive on the wire (compressed, for a delta),
    // and where from: "pusher" (a client's UploadModel) or "peer" (a chain
    // push's forward, or a pull on start).
    std::function<void(absl::string_view from, int64_t bytes)> on_upload_bytes;
  };

  // `manager` outlives the service.
  ModelRepositoryServiceImpl(const Options& options, ModelManager* manager);
  // Joins the load and upload threads.
  ~ModelRepositoryServiceImpl() override;

  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const detlogp::v1::ListModelsRequest* request,
      detlogp::v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* LoadModel(
      grpc::CallbackServerContext* context,
      const detlogp::v1::LoadModelRequest* request,
      detlogp::v1::ModelVersionStatus* response) override;
  // Reads UploadModelRequest messages; answers a ModelVersionStatus.
  grpc::ServerReadReactor<grpc::ByteBuffer>* UploadModel(
      grpc::CallbackServerContext* context,
      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnloadModel(
      grpc::CallbackServerContext* context,
      const detlogp::v1::UnloadModelRequest* request,
      detlogp::v1::UnloadModelResponse* response) override;
  // Two-phase publish and peer pulls (model_repository_versions.cc).
  grpc::ServerUnaryReactor* CommitVersion(
      grpc::CallbackServerContext* context,
      const detlogp::v1::CommitVersionRequest* request,
      detlogp::v1::ModelVersionStatus* response) override;
  grpc::ServerUnaryReactor* AbortVersion(
      grpc::CallbackServerContext* context,
      const detlogp::v1::AbortVersionRequest* request,
      detlogp::v1::AbortVersionResponse* response) override;
  grpc::ServerWriteReactor<detlogp::v1::UploadModelRequest>* DownloadModel(
      grpc::CallbackServerContext* context,
      const detlogp::v1::DownloadModelRequest* request) override;

 private:
  class UploadCall;
  class DownloadCall;

  // A version's weights from its files under --model_root (digest
  // checked); NOT_FOUND without any (DownloadModel reads the host copy or
  // the placed model first: server/models/version_bytes.h).
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> FileWeightsOf(
      const ServedVersion& version) const;

  grpc::Status Authorize(const grpc::CallbackServerContext& context) const;
  grpc::Status Record(absl::string_view method, grpc::Status status) const;
  // Finishes a unary call with `status` on the default reactor.
  grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                      absl::string_view method,
                                      grpc::Status status) const;

  const Options options_;
  ModelManager* const manager_;
  // Declared last: joined first, while everything its tasks use still lives.
  BackgroundTasks tasks_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_MODEL_REPOSITORY_SERVICE_H_
