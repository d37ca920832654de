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
//   // Every pod of a headless Service (each address of the name).
//   PushToTargets({"dns:///detlogp.ns.svc:50051"}, {}, admin, *upload);
//
//   // Only what changed since version 41, which both replicas hold.
//   auto delta = EncodeLmHeadDelta(*upload, *step_41, /*base_version=*/41);
//   PushToTargets(targets, {}, admin, *upload, {.delta = &*delta});
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
#include "client/push_targets.h"
#include "client/target_resolver.h"
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

// A delta upload's payload (UPLOAD_ENCODING_XOR_ZSTD): the zstd-compressed
// XOR of the new weights' bytes with a base version's, encoded once and sent
// to every replica that holds the base (docs/live_weights.md, "Delta
// uploads").
struct LmHeadDelta {
  int64_t base_version = 0;
  std::string base_weights_sha256;
  std::string weights_sha256;  // of the new weights, checked by the replica
  std::string bytes;           // one zstd frame
};

// Encodes `upload` against `base`, the weights the servers hold as version
// `base_version` (same shapes and bias, else INVALID_ARGUMENT naming
// `base`), compressing on `threads` threads.
absl::StatusOr<LmHeadDelta> EncodeLmHeadDelta(const LmHeadUpload& upload,
                                              const LmHeadUpload& base,
                                              int64_t base_version,
                                              int threads = 8);

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

  // Two-phase publish: makes a staged version (UploadOptions.stage) the
  // model's latest; `weights_sha256` (may be empty) must be its digest.
  absl::StatusOr<detlogp::v1::ModelVersionStatus> CommitVersion(
      const std::string& model, int64_t model_version,
      const std::string& weights_sha256);
  // Drops a staged version (OK when it is not staged there).
  absl::Status AbortVersion(const std::string& model, int64_t model_version);

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

  // Sends `delta` (encoded against a version this server should hold)
  // instead of the whole head: the server rebuilds the head, checks
  // delta.weights_sha256 and publishes it as a full upload would. A server
  // without the base answers FAILED_PRECONDITION with reason BASE_MISSING
  // (PushToTargets then sends it the whole head). `upload` gives the model,
  // shapes and version; its weights are not read.
  absl::StatusOr<detlogp::v1::ModelVersionStatus> UploadDelta(
      const LmHeadUpload& upload, const LmHeadDelta& delta,
      const UploadHooks& hooks = {});

  struct UploadOptions {
    // Publishes as this number instead of upload.version (0: keep it).
    int64_t version = 0;
    // Sent instead of the whole head (as UploadDelta); null: the head.
    const LmHeadDelta* delta = nullptr;
    // A chain push: the servers this one forwards the upload to, in order.
    std::vector<std::string> forward_to;
    // Two-phase publish: the server holds the version STAGED (needs a
    // version number) until CommitVersion.
    bool stage = false;
    UploadHooks hooks;
  };
  // UploadModel and UploadDelta in one call.
  absl::StatusOr<detlogp::v1::ModelVersionStatus> Upload(
      const LmHeadUpload& upload, const UploadOptions& options);

  // Sets the deadline and the admin token of a call made through stub().
  void PrepareContext(grpc::ClientContext* context) const;
  detlogp::v1::ModelRepositoryService::Stub* stub() { return stub_.get(); }
  const Options& options() const { return options_; }

 private:
  // Streams `header`, then `payload` in chunk_bytes chunks; checks that the
  // server reports `digest`.
  absl::StatusOr<detlogp::v1::ModelVersionStatus> Stream(
      const detlogp::v1::UploadModelHeader& header,
      const std::vector<absl::string_view>& payload, const UploadHooks& hooks);

  Options options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<detlogp::v1::ModelRepositoryService::Stub> stub_;
};

// One target's outcome of PushToTargets.
struct PushedVersion {
  // The server: a target as given, or one address of a "dns:" target.
  std::string target;
  // The "dns:" target `target` was resolved from (empty: given as is).
  std::string resolved_from;
  absl::StatusOr<detlogp::v1::ModelVersionStatus> version;
  // Whether the delta was taken (false: the whole head was sent, or none).
  bool sent_delta = false;
  // Payload bytes sent to this target (delta, then the head if it fell back).
  int64_t bytes_sent = 0;
  // Reached through the chain (from the previous server), not the pusher.
  bool via_chain = false;
  // Two-phase: when the pusher sent the commit, and when the server
  // answered it (absl::InfinitePast() without a commit).
  absl::Time commit_sent = absl::InfinitePast();
  absl::Time commit_answered = absl::InfinitePast();
};

struct PushOptions {
  // Sent instead of the whole head to every target; a target answering
  // BASE_MISSING gets the whole head. May be null.
  const LmHeadDelta* delta = nullptr;
  // kDirect: the pusher uploads to every target. kChain: to the first
  // target only, which forwards each message down the list as it arrives
  // (the pusher's egress does not grow with the targets); then every target
  // is asked whether it holds the version, and those the chain did not
  // reach (a server that failed, or lacked a delta's base, stops the chain
  // there) get it directly.
  enum class Fanout { kDirect, kChain };
  Fanout fanout = Fanout::kDirect;
  // With more than one target: stage the version on every target (uploads
  // with header.stage), then commit it on all of them at once (one
  // CommitVersion each, sent together once every target has answered a
  // warm-up call), or, when any target failed to stage, abort it on all of
  // them: no target changes what it serves. false: each target publishes
  // as its upload finishes (a failed target leaves the fleet mixed).
  bool two_phase = true;
  // Resolves "dns:" targets into their addresses (empty:
  // ResolveInPodOrder: a StatefulSet's pods in ordinal order); tests and
  // other service discovery inject their own.
  TargetResolver resolver;
};

struct PushReport {
  // One per server, in the order of the targets given (a "dns:" target's
  // addresses, sorted, in its place).
  std::vector<PushedVersion> targets;
  // OK when every target took the upload and all report the same
  // determinism key (and digest); else names the failed targets, or
  // FAILED_PRECONDITION listing the differing keys. A two-phase push that
  // was aborted is ABORTED, and the targets that had staged it report
  // ABORTED too.
  absl::Status status;
  // Two-phase: whether the commit phase ran (false: aborted, or one phase).
  bool committed = false;
};

// Uploads `upload` to every target concurrently (one connection each, with
// `connection`'s TLS and limits; its target is replaced). A "dns:" target
// (a headless Service) stands for every address its name resolves to
// (ExpandPushTargets, with push.resolver): each is a target of its own,
// numbered, staged, chained and committed like the others, its certificate
// checked against the name; a name that resolves to no address fails the
// push (UNAVAILABLE naming it) before any server is sent anything. Every
// replica publishes the same number: upload.version when set; else, with
// several servers, one above the highest number any server holds of the
// model (servers that cannot be asked are left out of that), so replicas
// started at different times agree.
PushReport PushToTargets(const std::vector<std::string>& targets,
                         const LogpClient::Options& connection,
                         const ModelRepositoryClient::Options& options,
                         const LmHeadUpload& upload,
                         const PushOptions& push = {});

// PushToTargets to servers already expanded (push.resolver is not used).
PushReport PushToFleet(const std::vector<PushTarget>& fleet,
                       const LogpClient::Options& connection,
                       const ModelRepositoryClient::Options& options,
                       const LmHeadUpload& upload,
                       const PushOptions& push = {});

// One above the highest version number of `model` that any target holds
// (1 when none holds it; a "dns:" target: any of its addresses, resolved
// with ResolveWithGetaddrinfo); an error when a target cannot be asked.
absl::StatusOr<int64_t> FleetVersion(
    const std::vector<std::string>& targets,
    const LogpClient::Options& connection,
    const ModelRepositoryClient::Options& options, const std::string& model);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_MODEL_REPOSITORY_CLIENT_H_
