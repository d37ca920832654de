#include "client/model_repository_client.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/push_targets.h"
#include "client/tensor_files.h"
#include "formats/checkpoint.h"
#include "kernels/bfloat16.h"
#include "digests/lm_head_digest.h"
#include "proto/status_details.h"
#include "proto/upload_delta.h"

namespace detlogp::client {
namespace {

using detlogp::v1::ModelVersionStatus;
using detlogp::v1::UploadModelRequest;

// The payload's bytes in wire order: the weight's, then the bias's.
std::vector<absl::string_view> PayloadOf(const LmHeadUpload& upload) {
  return {absl::string_view(reinterpret_cast<const char*>(upload.weight.data()),
                            upload.weight.size() * 2),
          absl::string_view(reinterpret_cast<const char*>(upload.bias.data()),
                            upload.bias.size() * 4)};
}

detlogp::v1::UploadModelHeader HeaderOf(const LmHeadUpload& upload) {
  detlogp::v1::UploadModelHeader header;
  header.set_model(upload.model);
  header.set_dtype(detlogp::v1::DTYPE_BFLOAT16);
  header.add_shape(upload.padded_vocab_size);
  header.add_shape(upload.hidden_size);
  header.set_vocab_size(upload.vocab_size);
  header.set_has_bias(!upload.bias.empty());
  header.set_model_version(upload.version);
  return header;
}

// Raw elements of a float tensor as floats.
std::vector<float> ToFloats(const LoadedTensor& tensor) {
  std::vector<float> out;
  const std::string& data = tensor.data;
  if (tensor.dtype == detlogp::v1::DTYPE_FLOAT32) {
    out.resize(data.size() / 4);
    std::memcpy(out.data(), data.data(), out.size() * 4);
    return out;
  }
  out.resize(data.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, data.data() + 2 * i, 2);
    out[i] = tensor.dtype == detlogp::v1::DTYPE_BFLOAT16
                 ? kernels::Bf16ToFloat(bits)
                 : kernels::Fp16ToFloat(bits);
  }
  return out;
}

}  // namespace

absl::Status ValidateLmHeadUpload(const LmHeadUpload& upload) {
  if (upload.hidden_size <= 0 || upload.hidden_size % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head: hidden size ", upload.hidden_size,
                     " must be > 0 and a multiple of 8"));
  }
  if (upload.padded_vocab_size <= 0 ||
      static_cast<int64_t>(upload.weight.size()) !=
          upload.padded_vocab_size * upload.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lm_head: weight holds ", upload.weight.size(), " values, not [",
        upload.padded_vocab_size, ", ", upload.hidden_size, "]"));
  }
  if (!upload.bias.empty() &&
      static_cast<int64_t>(upload.bias.size()) != upload.padded_vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head: bias holds ", upload.bias.size(),
                     " values, not ", upload.padded_vocab_size));
  }
  if (upload.version < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head: version ", upload.version,
                     " is negative (0 means the next)"));
  }
  if (upload.vocab_size < 0 || upload.vocab_size > upload.padded_vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head: vocab_size ", upload.vocab_size,
                     " is not in [0, ", upload.padded_vocab_size, "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LmHeadUpload> ReadLmHeadUpload(const std::string& model,
                                              const std::string& path,
                                              const std::string& weight_tensor,
                                              const std::string& bias_tensor,
                                              int64_t vocab_size,
                                              std::string* description) {
  formats::HeadLookup lookup;
  lookup.path = path;
  lookup.weight_tensor = weight_tensor;
  lookup.bias_tensor = bias_tensor;
  auto head = formats::ResolveHead(lookup);
  if (!head.ok()) return head.status();
  if (description != nullptr) *description = head->description;
  auto weight = ReadSafetensor(head->weight_file, head->weight_tensor);
  if (!weight.ok()) return weight.status();
  LmHeadUpload upload;
  upload.model = model;
  upload.padded_vocab_size = weight->shape[0];
  upload.hidden_size = weight->shape[1];
  upload.vocab_size = vocab_size;
  if (weight->dtype == detlogp::v1::DTYPE_BFLOAT16) {
    upload.weight.resize(weight->data.size() / 2);
    std::memcpy(upload.weight.data(), weight->data.data(),
                upload.weight.size() * 2);
  } else {
    const std::vector<float> values = ToFloats(*weight);
    upload.weight.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      upload.weight[i] = kernels::FloatToBf16(values[i]);
    }
  }
  if (!head->bias_tensor.empty()) {
    auto bias = ReadSafetensor(head->bias_file, head->bias_tensor);
    if (!bias.ok()) return bias.status();
    upload.bias = ToFloats(*bias);
  }
  if (absl::Status s = ValidateLmHeadUpload(upload); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  return upload;
}

std::string LmHeadUploadDigest(const LmHeadUpload& upload) {
  return digests::ComputeLmHeadDigest(
      {upload.hidden_size, upload.effective_vocab_size(),
       upload.padded_vocab_size, !upload.bias.empty()},
      upload.weight.data(), upload.bias.data());
}

absl::StatusOr<LmHeadDelta> EncodeLmHeadDelta(const LmHeadUpload& upload,
                                              const LmHeadUpload& base,
                                              int64_t base_version,
                                              int threads) {
  if (absl::Status s = ValidateLmHeadUpload(upload); !s.ok()) return s;
  if (base_version <= 0) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "base_version",
        absl::StrCat(base_version, " is not a version (> 0)"));
  }
  if (base.hidden_size != upload.hidden_size ||
      base.padded_vocab_size != upload.padded_vocab_size ||
      base.effective_vocab_size() != upload.effective_vocab_size() ||
      base.weight.size() != upload.weight.size() ||
      base.bias.size() != upload.bias.size()) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "base",
        absl::StrCat("the base is [", base.padded_vocab_size, ", ",
                     base.hidden_size, "] bias=", !base.bias.empty(),
                     ", the new weights [", upload.padded_vocab_size, ", ",
                     upload.hidden_size, "] bias=", !upload.bias.empty()));
  }
  v1::XorDeltaOptions options;
  options.threads = threads;
  auto bytes = v1::EncodeXorDelta(PayloadOf(upload), PayloadOf(base), options);
  if (!bytes.ok()) return bytes.status();
  LmHeadDelta delta;
  delta.base_version = base_version;
  delta.base_weights_sha256 = LmHeadUploadDigest(base);
  delta.weights_sha256 = LmHeadUploadDigest(upload);
  delta.bytes = *std::move(bytes);
  return delta;
}

// ------------------------------------------------------------------ client

ModelRepositoryClient::ModelRepositoryClient(
    std::shared_ptr<grpc::Channel> channel, const Options& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(detlogp::v1::ModelRepositoryService::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<ModelRepositoryClient>>
ModelRepositoryClient::Create(const LogpClient::Options& connection,
                              const Options& options) {
  if (connection.target.empty()) {
    return absl::InvalidArgumentError("client: empty target");
  }
  if (options.chunk_bytes <= 0) {
    return absl::InvalidArgumentError("client: chunk_bytes must be > 0");
  }
  return std::make_unique<ModelRepositoryClient>(MakeChannel(connection),
                                                 options);
}

void ModelRepositoryClient::PrepareContext(grpc::ClientContext* context) const {
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!options_.admin_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.admin_token);
  }
}

absl::StatusOr<detlogp::v1::ListModelsResponse>
ModelRepositoryClient::ListModels() {
  grpc::ClientContext context;
  PrepareContext(&context);
  detlogp::v1::ListModelsResponse response;
  const grpc::Status status =
      stub_->ListModels(&context, detlogp::v1::ListModelsRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<ModelVersionStatus> ModelRepositoryClient::LoadModel(
    const detlogp::v1::LoadModelRequest& request) {
  grpc::ClientContext context;
  PrepareContext(&context);
  ModelVersionStatus response;
  const grpc::Status status = stub_->LoadModel(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<ModelVersionStatus> ModelRepositoryClient::LoadModel(
    const std::string& model, const std::string& path) {
  detlogp::v1::LoadModelRequest request;
  request.set_model(model);
  request.set_path(path);
  return LoadModel(request);
}

absl::Status ModelRepositoryClient::UnloadModel(const std::string& model,
                                                int64_t model_version) {
  grpc::ClientContext context;
  PrepareContext(&context);
  detlogp::v1::UnloadModelRequest request;
  request.set_model(model);
  request.set_model_version(model_version);
  detlogp::v1::UnloadModelResponse response;
  return FromGrpcStatus(stub_->UnloadModel(&context, request, &response));
}

absl::StatusOr<ModelVersionStatus> ModelRepositoryClient::CommitVersion(
    const std::string& model, int64_t model_version,
    const std::string& weights_sha256) {
  grpc::ClientContext context;
  PrepareContext(&context);
  detlogp::v1::CommitVersionRequest request;
  request.set_model(model);
  request.set_model_version(model_version);
  request.set_weights_sha256(weights_sha256);
  ModelVersionStatus response;
  const grpc::Status status =
      stub_->CommitVersion(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status ModelRepositoryClient::AbortVersion(const std::string& model,
                                                 int64_t model_version) {
  grpc::ClientContext context;
  PrepareContext(&context);
  detlogp::v1::AbortVersionRequest request;
  request.set_model(model);
  request.set_model_version(model_version);
  detlogp::v1::AbortVersionResponse response;
  return FromGrpcStatus(stub_->AbortVersion(&context, request, &response));
}

absl::StatusOr<ModelVersionStatus> ModelRepositoryClient::UploadModel(
    const LmHeadUpload& upload, const UploadHooks& hooks) {
  UploadOptions options;
  options.hooks = hooks;
  return Upload(upload, options);
}

absl::StatusOr<ModelVersionStatus> ModelRepositoryClient::UploadDelta(
    const LmHeadUpload& upload, const LmHeadDelta& delta,
    const UploadHooks& hooks) {
  UploadOptions options;
  options.delta = &delta;
  options.hooks = hooks;
  return Upload(upload, options);
}

absl::StatusOr<ModelVersionStatus> ModelRepositoryClient::Upload(
    const LmHeadUpload& upload, const UploadOptions& options) {
  if (absl::Status s = ValidateLmHeadUpload(upload); !s.ok()) return s;
  detlogp::v1::UploadModelHeader header = HeaderOf(upload);
  if (options.version != 0) header.set_model_version(options.version);
  header.set_stage(options.stage);
  for (const std::string& next : options.forward_to) {
    header.add_forward_to(next);
  }
  if (options.delta == nullptr) {
    // Its blocks hash on every core in a fraction of the transfer's time,
    // so the digest travels in the header.
    header.set_weights_sha256(LmHeadUploadDigest(upload));
    return Stream(header, PayloadOf(upload), options.hooks);
  }
  const LmHeadDelta& delta = *options.delta;
  header.set_weights_sha256(delta.weights_sha256);
  header.set_encoding(detlogp::v1::UPLOAD_ENCODING_XOR_ZSTD);
  header.set_base_version(delta.base_version);
  header.set_base_weights_sha256(delta.base_weights_sha256);
  return Stream(header, {delta.bytes}, options.hooks);
}

absl::StatusOr<ModelVersionStatus> ModelRepositoryClient::Stream(
    const detlogp::v1::UploadModelHeader& header,
    const std::vector<absl::string_view>& payload, const UploadHooks& hooks) {
  grpc::ClientContext context;
  PrepareContext(&context);
  ModelVersionStatus response;
  std::unique_ptr<grpc::ClientWriter<UploadModelRequest>> writer =
      stub_->UploadModel(&context, &response);

  UploadModelRequest message;
  *message.mutable_header() = header;
  // A failed write means the server has ended the call (e.g. the header was
  // refused); Finish says why.
  bool open = writer->Write(message);

  // A chunk may hold the end of one part and the start of the next.
  int64_t total = 0;
  for (absl::string_view part : payload) total += part.size();
  int64_t sent = 0;
  bool cancelled = false;
  while (open && sent < total) {
    const int64_t size = std::min<int64_t>(options_.chunk_bytes, total - sent);
    std::string* chunk = message.mutable_chunk();
    chunk->clear();
    chunk->reserve(size);
    int64_t begin = 0;
    for (absl::string_view part : payload) {
      const int64_t end = begin + static_cast<int64_t>(part.size());
      const int64_t from = std::max<int64_t>(sent, begin);
      const int64_t to = std::min<int64_t>(sent + size, end);
      if (to > from) chunk->append(part.data() + (from - begin), to - from);
      begin = end;
    }
    open = writer->Write(message);
    sent += size;
    if (open && hooks.after_chunk && !hooks.after_chunk(sent, total)) {
      context.TryCancel();
      cancelled = true;
      break;
    }
  }
  if (open && !cancelled) writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (cancelled) {
    return absl::CancelledError(absl::StrCat("upload of ", header.model(),
                                             " cancelled after ", sent, " of ",
                                             total, " bytes"));
  }
  if (!status.ok()) return FromGrpcStatus(status);
  if (response.weights_sha256() != header.weights_sha256()) {
    return absl::DataLossError(
        absl::StrCat("upload of ", header.model(),
                     ": the server reports weights ", response.weights_sha256(),
                     ", the client sent ", header.weights_sha256()));
  }
  return response;
}

// ---------------------------------------------------------------- push

namespace {

// A client of its own for one server of a push.
absl::StatusOr<std::unique_ptr<ModelRepositoryClient>> Connect(
    const PushTarget& target, const LogpClient::Options& connection,
    const ModelRepositoryClient::Options& options) {
  if (target.target.empty()) {
    return absl::InvalidArgumentError("client: empty target");
  }
  if (options.chunk_bytes <= 0) {
    return absl::InvalidArgumentError("client: chunk_bytes must be > 0");
  }
  return std::make_unique<ModelRepositoryClient>(
      MakePushChannel(connection, target), options);
}

// The highest version number of `model` each target holds (0: none), or
// why that target could not be asked.
std::vector<absl::StatusOr<int64_t>> HighestVersions(
    const std::vector<PushTarget>& targets,
    const LogpClient::Options& connection,
    const ModelRepositoryClient::Options& options, const std::string& model) {
  std::vector<absl::StatusOr<int64_t>> highest(targets.size(), int64_t{0});
  std::vector<std::thread> threads;
  for (size_t i = 0; i < targets.size(); ++i) {
    threads.emplace_back([&, i] {
      auto client = Connect(targets[i], connection, options);
      if (!client.ok()) {
        highest[i] = client.status();
        return;
      }
      auto models = (*client)->ListModels();
      if (!models.ok()) {
        highest[i] = models.status();
        return;
      }
      int64_t top = 0;
      for (const detlogp::v1::ModelInfo& info : models->models()) {
        if (info.model() != model) continue;
        top = std::max(top, info.model_version());
        for (const auto& version : info.versions()) {
          top = std::max(top, version.version());
        }
      }
      highest[i] = top;
    });
  }
  for (std::thread& thread : threads) thread.join();
  return highest;
}

}  // namespace

absl::StatusOr<int64_t> FleetVersion(
    const std::vector<std::string>& targets,
    const LogpClient::Options& connection,
    const ModelRepositoryClient::Options& options, const std::string& model) {
  absl::StatusOr<std::vector<PushTarget>> fleet =
      ExpandPushTargets(targets, ResolveInPodOrder);
  if (!fleet.ok()) return fleet.status();
  const std::vector<absl::StatusOr<int64_t>> highest =
      HighestVersions(*fleet, connection, options, model);
  int64_t top = 0;
  for (size_t i = 0; i < fleet->size(); ++i) {
    if (!highest[i].ok()) {
      return absl::Status(
          highest[i].status().code(),
          absl::StrCat("numbering the push: listing the models of ",
                       (*fleet)[i].target, ": ",
                       highest[i].status().message()));
    }
    top = std::max(top, *highest[i]);
  }
  return top + 1;
}

namespace {

// Uploads to one target: the delta when given, the whole head when there
// is none or the target lacks its base; `forward_to` makes it the head of a
// chain.
PushedVersion PushOne(const PushTarget& target,
                      const LogpClient::Options& connection,
                      const ModelRepositoryClient::Options& options,
                      const LmHeadUpload& upload, int64_t version,
                      const LmHeadDelta* delta,
                      const std::vector<std::string>& forward_to, bool stage) {
  PushedVersion out;
  out.target = target.target;
  out.resolved_from = target.resolved_from;
  auto client = Connect(target, connection, options);
  if (!client.ok()) {
    out.version = client.status();
    return out;
  }
  ModelRepositoryClient::UploadOptions upload_options;
  upload_options.version = version;
  upload_options.forward_to = forward_to;
  upload_options.stage = stage;
  int64_t sent = 0;
  upload_options.hooks.after_chunk = [&sent](int64_t so_far, int64_t) {
    sent = so_far;
    return true;
  };
  if (delta != nullptr) {
    upload_options.delta = delta;
    out.version = (*client)->Upload(upload, upload_options);
    out.bytes_sent += sent;
    out.sent_delta = out.version.ok();
    // A replica without the base gets the whole head.
    if (out.version.ok() ||
        v1::DetailsOf(out.version.status()).reason != v1::kReasonBaseMissing) {
      return out;
    }
    upload_options.delta = nullptr;
    sent = 0;
  }
  out.version = (*client)->Upload(upload, upload_options);
  out.bytes_sent += sent;
  return out;
}

// The target's status of `version` of `model` when it holds it with
// `digest`; nothing when it does not (or cannot be asked).
std::optional<ModelVersionStatus> HeldVersion(
    const PushTarget& target, const LogpClient::Options& connection,
    const ModelRepositoryClient::Options& options, const std::string& model,
    int64_t version, const std::string& digest,
    ModelVersionStatus::State state) {
  auto client = Connect(target, connection, options);
  if (!client.ok()) return std::nullopt;
  auto models = (*client)->ListModels();
  if (!models.ok()) return std::nullopt;
  for (const detlogp::v1::ModelInfo& info : models->models()) {
    if (info.model() != model) continue;
    for (const ModelVersionStatus& held : info.versions()) {
      if (held.version() == version && held.weights_sha256() == digest &&
          held.state() == state) {
        return held;
      }
    }
  }
  return std::nullopt;
}

// Two-phase publish's end: every target staged the version -> commit on all
// of them at once; else abort on all of them (and mark the staged ones
// ABORTED in the report).
void FinishTwoPhase(const std::vector<PushTarget>& targets,
                    const LogpClient::Options& connection,
                    const ModelRepositoryClient::Options& options,
                    const std::string& model, int64_t version,
                    PushReport* report) {
  std::string failed;
  std::string digest;
  for (const PushedVersion& pushed : report->targets) {
    if (!pushed.version.ok()) {
      failed = pushed.target;
    } else if (digest.empty()) {
      digest = pushed.version->weights_sha256();
    }
  }
  std::vector<std::unique_ptr<ModelRepositoryClient>> clients(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    auto client = Connect(targets[i], connection, options);
    if (client.ok()) clients[i] = *std::move(client);
  }
  std::vector<std::thread> threads;
  if (!failed.empty()) {
    for (size_t i = 0; i < targets.size(); ++i) {
      if (clients[i] == nullptr) continue;
      threads.emplace_back([&, i] {
        // Every target, staged or not: a chain may have staged it on a
        // target whose answer was lost.
        const absl::Status aborted = clients[i]->AbortVersion(model, version);
        PushedVersion& pushed = report->targets[i];
        if (pushed.version.ok()) {
          pushed.version = absl::AbortedError(absl::StrCat(
              "staged, then aborted (", failed, " failed to stage)",
              aborted.ok() ? "" : "; the abort failed: ",
              aborted.ok() ? "" : aborted.ToString()));
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    return;
  }
  // Each connection is made and used once before any commit goes, so the
  // commits leave together and the skew window is one round trip wide.
  struct Gate {
    int warmed = 0;
    int all = 0;
    bool AllWarm() const { return warmed == all; }
  };
  absl::Mutex mu;
  Gate gate{0, static_cast<int>(targets.size())};
  bool go = false;
  for (size_t i = 0; i < targets.size(); ++i) {
    threads.emplace_back([&, i] {
      if (clients[i] != nullptr) (void)clients[i]->ListModels();
      {
        absl::MutexLock lock(&mu);
        ++gate.warmed;
        mu.Await(absl::Condition(&go));
      }
      PushedVersion& pushed = report->targets[i];
      if (clients[i] == nullptr) {
        pushed.version = absl::UnavailableError("no connection for the commit");
        return;
      }
      pushed.commit_sent = absl::Now();
      pushed.version = clients[i]->CommitVersion(model, version, digest);
      pushed.commit_answered = absl::Now();
    });
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&gate, &Gate::AllWarm));
    go = true;
  }
  for (std::thread& thread : threads) thread.join();
  report->committed = true;
}

}  // namespace

PushReport PushToTargets(const std::vector<std::string>& targets,
                         const LogpClient::Options& connection,
                         const ModelRepositoryClient::Options& options,
                         const LmHeadUpload& upload, const PushOptions& push) {
  absl::StatusOr<std::vector<PushTarget>> fleet =
      ExpandPushTargets(targets, push.resolver);
  if (!fleet.ok()) {
    PushReport report;
    report.status = fleet.status();
    return report;
  }
  return PushToFleet(*fleet, connection, options, upload, push);
}

PushReport PushToFleet(const std::vector<PushTarget>& targets,
                       const LogpClient::Options& connection,
                       const ModelRepositoryClient::Options& options,
                       const LmHeadUpload& upload, const PushOptions& push) {
  PushReport report;
  if (targets.empty()) {
    report.status = absl::InvalidArgumentError("push: no targets");
    return report;
  }
  // One number for the whole fleet: otherwise each replica would take its
  // own next number and the same push would be numbered differently.
  // A target that cannot be asked does not stop the push: its upload fails
  // below and the report names it, while the others agree on a number.
  int64_t version = upload.version;
  if (version == 0 && targets.size() > 1) {
    for (const absl::StatusOr<int64_t>& highest :
         HighestVersions(targets, connection, options, upload.model)) {
      if (highest.ok()) version = std::max(version, *highest + 1);
    }
    if (version == 0) version = 1;  // no target answered; their uploads fail
  }
  const bool two_phase = push.two_phase && targets.size() > 1;
  const ModelVersionStatus::State uploaded_state =
      two_phase ? ModelVersionStatus::STAGED : ModelVersionStatus::READY;
  report.targets.resize(targets.size());
  std::vector<bool> pending(targets.size(), true);
  if (push.fanout == PushOptions::Fanout::kChain && targets.size() > 1 &&
      version > 0) {
    // The first target forwards every message down the chain as it
    // arrives; then each target says whether it holds the version.
    std::vector<std::string> rest;
    for (size_t i = 1; i < targets.size(); ++i) {
      rest.push_back(targets[i].target);
    }
    report.targets[0] = PushOne(targets[0], connection, options, upload,
                                version, push.delta, rest, two_phase);
    const std::string digest = push.delta != nullptr
                                   ? push.delta->weights_sha256
                                   : LmHeadUploadDigest(upload);
    pending[0] = false;
    for (size_t i = 1; i < targets.size(); ++i) {
      auto held = HeldVersion(targets[i], connection, options, upload.model,
                              version, digest, uploaded_state);
      if (held.has_value()) {
        report.targets[i].target = targets[i].target;
        report.targets[i].resolved_from = targets[i].resolved_from;
        report.targets[i].version = *std::move(held);
        report.targets[i].via_chain = true;
        pending[i] = false;
      }
    }
  }
  // Directly to every target the chain did not reach (all of them for a
  // direct push).
  std::vector<std::thread> threads;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (!pending[i]) continue;
    threads.emplace_back([&, i] {
      report.targets[i] = PushOne(targets[i], connection, options, upload,
                                  version, push.delta, {}, two_phase);
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (two_phase) {
    FinishTwoPhase(targets, connection, options, upload.model, version,
                   &report);
  }

  std::vector<std::string> failed;
  std::vector<std::string> keys;
  const ModelVersionStatus* first = nullptr;
  bool keys_differ = false;
  for (const PushedVersion& pushed : report.targets) {
    if (!pushed.version.ok()) {
      failed.push_back(absl::StrCat(pushed.target, ": ",
                                    pushed.version.status().ToString()));
      continue;
    }
    if (first == nullptr) first = &*pushed.version;
    keys_differ =
        keys_differ ||
        pushed.version->determinism_key() != first->determinism_key() ||
        pushed.version->weights_sha256() != first->weights_sha256();
    keys.push_back(absl::StrCat(pushed.target, ": v", pushed.version->version(),
                                " key ", pushed.version->determinism_key(),
                                " weights ", pushed.version->weights_sha256()));
  }
  if (!failed.empty() && two_phase && !report.committed) {
    report.status = absl::AbortedError(
        absl::StrCat("push aborted: ", failed.size(), " of ", targets.size(),
                     " targets failed to stage version ", version,
                     "; every target keeps the versions it had (",
                     absl::StrJoin(failed, "; "), ")"));
  } else if (!failed.empty()) {
    report.status = absl::Status(
        report.targets.size() == 1 ? report.targets[0].version.status().code()
                                   : absl::StatusCode::kAborted,
        absl::StrCat("push: ", failed.size(), " of ", targets.size(),
                     " targets failed (", absl::StrJoin(failed, "; "), ")",
                     keys.empty() ? "" : "; uploaded to ",
                     absl::StrJoin(keys, "; ")));
  } else if (keys_differ) {
    report.status = absl::FailedPreconditionError(absl::StrCat(
        "push: the targets report different determinism keys for the same "
        "weights (",
        absl::StrJoin(keys, "; "), ")"));
  }
  return report;
}

}  // namespace detlogp::client
