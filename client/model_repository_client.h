// A C++ client for detlogp's ModelRepositoryService: lists, loads, uploads
// and unloads lm_head model versions while the server serves
// (docs/live_weights.md).
//
//   ModelRepositoryClient::Options admin;
//   admin.admin_token = "...";  // from --admin_tokens_file on the server
//   auto repo = ModelRepositoryClient::Create({.target = "10.0.0.1:50051"},
//   admin); auto upload = ReadLmHeadUpload("policy", "step_42.safetensors");
//   auto version = (*repo)->UploadModel(*upload);  // version, sha, key
//
//   // The same weights to every replica; their keys must agree.
//   PushReport report = PushToTargets({"a:50051", "b:50051"}, {}, admin,
//   *upload);
//
// The admin token goes only on these calls: scoring calls (LogpClient) carry
// LogpClient::Options::bearer_token instead.
#ifndef DETLOGP_CLIENT_MODEL_REPOSITORY_CLIENT_H_
#define DETLOGP_CLIENT_MODEL_REPOSITORY_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/logp_client.h"
#include "detlogp/v1/detlogp.grpc.pb.h"

namespace detlogp::client {

// An lm_head as UploadModel sends it: bf16 weight rows, optional fp32 bias.
struct LmHeadUpload {
  std::string model;
  int64_t hidden_size = 0;
  int64_t padded_vocab_size = 0;  // rows of `weight`
  int64_t vocab_size = 0;         // real vocabulary; 0 means every row
  std::vector<uint16_t> weight;   // bf16 bits, [padded_vocab_size, hidden_size]
  std::vector<float> bias;        // [padded_vocab_size], or empty
  // The number to publish it as; 0: the model's next. A trainer pushing to
  // several replicas names it, so they all number the version alike; it
  // must be above every number the model has had (else FAILED_PRECONDITION).
  int64_t version = 0;

  // The vocabulary the server records (vocab_size, or every row).
  int64_t effective_vocab_size() const {
    return vocab_size == 0 ? padded_vocab_size : vocab_size;
  }
  // Weight bytes plus bias bytes: what the chunks carry.
  int64_t payload_bytes() const {
    return static_cast<int64_t>(weight.size() * 2 + bias.size() * 4);
  }
};

// Checks shapes: H > 0 and a multiple of 8, weight [V_pad, H], bias [V_pad]
// or empty, 0 <= vocab_size <= V_pad. INVALID_ARGUMENT otherwise.
absl::Status ValidateLmHeadUpload(const LmHeadUpload& upload);

// Reads an lm_head from a Hugging Face checkpoint directory or a
// .safetensors file, found as the server finds it
// (formats/checkpoint.h: empty `weight_tensor` means lm_head.weight,
// else the tied input embedding; empty `bias_tensor` means lm_head.bias when
// present). Only the head's bytes are read: the weight [V_pad, H] in F32, F16
// or BF16 (F32 and F16 rounded to bf16, round-to-nearest-even, as the server
// rounds), the bias [V_pad] in any of those, widened to fp32. `description`,
// when not null, receives which tensor of which file was read.
absl::StatusOr<LmHeadUpload> ReadLmHeadUpload(
    const std::string& model, const std::string& path,
    const std::string& weight_tensor = "", const std::string& bias_tensor = "",
    int64_t vocab_size = 0, std::string* description = nullptr);

// The weights' digest as ModelVersionStatus.weights_sha256 reports it
// (digests/lm_head_digest.h), its blocks hashed on every core.
std::string LmHeadUploadDigest(const LmHeadUpload& upload);

class ModelRepositoryClient {
 public:
  struct Options {
    // Sent as "authorization: Bearer <admin_token>" on every call of this
    // client when not empty (a token from the server's --admin_tokens_file).
    std::string admin_token;
    // Per-call deadline. Generous: an upload moves the whole lm_head, and
    // UnloadModel waits for the requests still using the version.
    absl::Duration timeout = absl::Minutes(10);
    // Bytes per upload chunk.
    int64_t chunk_bytes = 4 << 20;
  };

  // Connects with `connection` (target, TLS, message limits; its
  // bearer_token and timeout are not used here).
  static absl::StatusOr<std::unique_ptr<ModelRepositoryClient>> Create(
      const LogpClient::Options& connection, const Options& options);
  // Shares a channel, e.g. a LogpClient's.
  ModelRepositoryClient(std::shared_ptr<grpc::Channel> channel,
                        const Options& options);

  absl::StatusOr<detlogp::v1::ListModelsResponse> ListModels();

  // Loads a file under the server's --model_root as the model's next
  // version, or as request.model_version (request.path is relative to the
  // root).
  absl::StatusOr<detlogp::v1::ModelVersionStatus> LoadModel(
      const detlogp::v1::LoadModelRequest& request);
  absl::StatusOr<detlogp::v1::ModelVersionStatus> LoadModel(
      const std::string& model, const std::string& path);

  // Refuses the version to new requests and returns once the requests that
  // picked it are answered and it is freed.
  absl::Status UnloadModel(const std::string& model, int64_t model_version);

  struct UploadHooks {
    // Called after each chunk is written with the payload bytes sent so far
    // and the total; returning false cancels the upload (CANCELLED).
    std::function<bool(int64_t sent, int64_t total)> after_chunk;
  };
  // Streams the header, the weight and bias in chunk_bytes chunks, then the
  // digest (hashed while sending). Returns the new version once it is the
  // model's latest; DATA_LOSS if the server reports another digest.
  absl::StatusOr<detlogp::v1::ModelVersionStatus> UploadModel(
      const LmHeadUpload& upload, const UploadHooks& hooks = {});

  // Sets the deadline and the admin token of a call made through stub().
  void PrepareContext(grpc::ClientContext* context) const;
  detlogp::v1::ModelRepositoryService::Stub* stub() { return stub_.get(); }
  const Options& options() const { return options_; }

 private:
  Options options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<detlogp::v1::ModelRepositoryService::Stub> stub_;
};

// One target's outcome of PushToTargets.
struct PushedVersion {
  std::string target;
  absl::StatusOr<detlogp::v1::ModelVersionStatus> version;
};

struct PushReport {
  // In the order of the targets given.
  std::vector<PushedVersion> targets;
  // OK when every target took the upload and all report the same
  // determinism key (and digest); else names the failed targets, or
  // FAILED_PRECONDITION listing the differing keys.
  absl::Status status;
};

// Uploads `upload` to every target concurrently (one connection each, with
// `connection`'s TLS and limits; its target is replaced). Set
// upload.version so that every replica publishes the same number.
PushReport PushToTargets(const std::vector<std::string>& targets,
                         const LogpClient::Options& connection,
                         const ModelRepositoryClient::Options& options,
                         const LmHeadUpload& upload);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_MODEL_REPOSITORY_CLIENT_H_
