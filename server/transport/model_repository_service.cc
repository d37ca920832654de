#include "server/transport/model_repository_service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include <grpcpp/create_channel.h>

#include "proto/upload_delta.h"
#include "server/models/upload_assembler.h"
#include "server/models/version_bytes.h"
#include "server/transport/grpc_status.h"
#include "server/transport/received_upload.h"
#include "server/transport/rejected_call.h"
#include "server/transport/upload_forward_stream.h"
#include "spdlog/spdlog.h"
#include "proto/status_details.h"

namespace detlogp::server {
namespace {

using detlogp::v1::ModelVersionStatus;
using detlogp::v1::UploadModelHeader;
using detlogp::v1::UploadModelRequest;

// Shapes the kernels take: H a multiple of 8 up to 64Ki, V within int32.
constexpr int64_t kMaxHiddenSize = 1 << 16;
constexpr int64_t kMaxPaddedVocab = (int64_t{1} << 31) - 1;

bool IsHexDigest(const std::string& text) {
  if (text.size() != 64) return false;
  for (char c : text) {
    if (!absl::ascii_isxdigit(c) || absl::ascii_isupper(c)) return false;
  }
  return true;
}

absl::StatusOr<digests::LmHeadShape> ValidateUploadHeader(
    const UploadModelHeader& header) {
  if (absl::Status s = ValidateModelName(header.model(), "header.model");
      !s.ok()) {
    return s;
  }
  if (header.dtype() != detlogp::v1::DTYPE_BFLOAT16) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "header.dtype",
        "uploads carry bf16 weights (DTYPE_BFLOAT16); round "
        "fp32/fp16 to bf16 (round-to-nearest-even) before sending");
  }
  if (header.shape_size() != 2 || header.shape(0) <= 0 ||
      header.shape(1) <= 0 || header.shape(0) > kMaxPaddedVocab ||
      header.shape(1) > kMaxHiddenSize || header.shape(1) % 8 != 0) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "header.shape",
        absl::StrCat("expected [padded_vocab_size, hidden_size] "
                     "with 0 < V <= ",
                     kMaxPaddedVocab, " and 0 < H <= ", kMaxHiddenSize,
                     ", H a multiple of 8"));
  }
  digests::LmHeadShape shape;
  shape.padded_vocab_size = header.shape(0);
  shape.hidden_size = header.shape(1);
  shape.vocab_size =
      header.vocab_size() == 0 ? shape.padded_vocab_size : header.vocab_size();
  if (shape.vocab_size < 0 || shape.vocab_size > shape.padded_vocab_size) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "header.vocab_size",
        absl::StrCat(header.vocab_size(), " is not in [0, ",
                     shape.padded_vocab_size, "] (0 means every row)"));
  }
  shape.has_bias = header.has_bias();
  switch (header.encoding()) {
    case detlogp::v1::UPLOAD_ENCODING_RAW:
      if (header.base_version() != 0 || !header.base_weights_sha256().empty()) {
        return v1::FieldError(absl::StatusCode::kInvalidArgument,
                              "header.base_version",
                              "a base is named only with encoding "
                              "UPLOAD_ENCODING_XOR_ZSTD");
      }
      break;
    case detlogp::v1::UPLOAD_ENCODING_XOR_ZSTD:
      if (header.base_version() <= 0) {
        return v1::FieldError(absl::StatusCode::kInvalidArgument,
                              "header.base_version",
                              "a delta names the version it applies to (> 0)");
      }
      if (!IsHexDigest(header.base_weights_sha256())) {
        return v1::FieldError(absl::StatusCode::kInvalidArgument,
                              "header.base_weights_sha256",
                              "a delta names its base's digest (64 lowercase "
                              "hex digits)");
      }
      break;
    default:
      return v1::FieldError(
          absl::StatusCode::kInvalidArgument, "header.encoding",
          absl::StrCat("unknown encoding ", header.encoding()));
  }
  if (header.stage() && header.model_version() <= 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument,
                          "header.model_version",
                          "a staged upload names its number (> 0), which "
                          "CommitVersion names again");
  }
  if (!header.weights_sha256().empty() &&
      !IsHexDigest(header.weights_sha256())) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument,
                          "header.weights_sha256",
                          "expected 64 lowercase hex digits");
  }
  return shape;
}

absl::Status BaseMissing(int64_t base_version, absl::string_view why) {
  return v1::FieldError(
      absl::StatusCode::kFailedPrecondition, "header.base_version",
      absl::StrCat(why, "; send the whole head instead"),
      v1::kReasonBaseMissing, {{"base_version", absl::StrCat(base_version)}});
}

}  // namespace

ModelRepositoryServiceImpl::ModelRepositoryServiceImpl(const Options& options,
                                                       ModelManager* manager)
    : options_(options), manager_(manager) {}

ModelRepositoryServiceImpl::~ModelRepositoryServiceImpl() = default;

grpc::Status ModelRepositoryServiceImpl::Record(absl::string_view method,
                                                grpc::Status status) const {
  if (options_.on_call_done) options_.on_call_done(method, status.error_code());
  return status;
}

grpc::Status ModelRepositoryServiceImpl::Authorize(
    const grpc::CallbackServerContext& context) const {
  if (options_.admin_authenticator != nullptr) {
    absl::Status s = options_.admin_authenticator->Check(context);
    if (!s.ok()) {
      return ToGrpcStatus(absl::UnauthenticatedError(absl::StrCat(
          "admin call: ", s.message(), " (a token from --admin_tokens_file)")));
    }
    return grpc::Status::OK;
  }
  if (options_.allow_without_admin_token) return grpc::Status::OK;
  return ToGrpcStatus(absl::PermissionDeniedError(
      "admin calls are refused: the server listens beyond loopback and has no "
      "--admin_tokens_file"));
}

grpc::ServerUnaryReactor* ModelRepositoryServiceImpl::FinishNow(
    grpc::CallbackServerContext* context, absl::string_view method,
    grpc::Status status) const {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(Record(method, std::move(status)));
  return reactor;
}

grpc::ServerUnaryReactor* ModelRepositoryServiceImpl::ListModels(
    grpc::CallbackServerContext* context,
    const detlogp::v1::ListModelsRequest* /*request*/,
    detlogp::v1::ListModelsResponse* response) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) {
    return FinishNow(context, "ListModels", denied);
  }
  for (auto& info : manager_->DescribeAll())
    *response->add_models() = std::move(info);
  response->set_default_model(manager_->default_model());
  return FinishNow(context, "ListModels", grpc::Status::OK);
}

grpc::ServerUnaryReactor* ModelRepositoryServiceImpl::LoadModel(
    grpc::CallbackServerContext* context,
    const detlogp::v1::LoadModelRequest* request,
    ModelVersionStatus* response) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) {
    return FinishNow(context, "LoadModel", denied);
  }
  if (absl::Status s = ValidateModelName(request->model(), "model"); !s.ok()) {
    return FinishNow(context, "LoadModel", ToGrpcStatus(s));
  }
  if (options_.store == nullptr) {
    return FinishNow(context, "LoadModel",
                     ToGrpcStatus(absl::FailedPreconditionError(
                         "LoadModel reads files under --model_root, which this "
                         "server was started without; use UploadModel")));
  }
  auto path = options_.store->ResolveInside(request->path(), "path");
  if (!path.ok())
    return FinishNow(context, "LoadModel", ToGrpcStatus(path.status()));
  if (absl::Status s = manager_->CheckVersionNumber(request->model(),
                                                    request->model_version());
      !s.ok()) {
    return FinishNow(context, "LoadModel", ToGrpcStatus(s));
  }
  if (!request->expected_weights_sha256().empty() &&
      !IsHexDigest(request->expected_weights_sha256())) {
    return FinishNow(
        context, "LoadModel",
        ToGrpcStatus(v1::FieldError(absl::StatusCode::kInvalidArgument,
                                    "expected_weights_sha256",
                                    "expected 64 lowercase hex digits")));
  }
  LmHeadSource source;
  source.path = *path;
  source.confine_to = options_.store->root();
  source.weight_tensor = request->lm_head_tensor();
  source.bias_tensor = request->bias_tensor();
  source.vocab_size = request->vocab_size();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  tasks_.Start([this, reactor, response, source, model = request->model(),
                relative = request->path(), version = request->model_version(),
                expected = request->expected_weights_sha256()]() {
    absl::Status status = [&]() -> absl::Status {
      auto weights = LoadLmHead(source);
      if (!weights.ok()) return weights.status();
      if (!expected.empty() && weights->sha256 != expected) {
        return v1::FieldError(
            absl::StatusCode::kInvalidArgument, "expected_weights_sha256",
            absl::StrCat(relative, " holds weights ", weights->sha256));
      }
      VersionOrigin origin;
      origin.description = absl::StrCat("load:", relative);
      origin.version = version;
      const std::string sha = weights->sha256;
      origin.persist = [this, model, source, sha](int64_t version) {
        return options_.store->RecordLoaded(model, version, source, sha);
      };
      auto added = manager_->AddVersion(
          model, std::make_shared<const LmHeadWeights>(*std::move(weights)),
          std::move(origin));
      if (!added.ok()) return added.status();
      *response = *std::move(added);
      return absl::OkStatus();
    }();
    if (!status.ok()) {
      spdlog::warn("LoadModel {} from {} refused: {}", model, relative,
                   status.ToString());
    }
    reactor->Finish(Record("LoadModel", ToGrpcStatus(status)));
  });
  return reactor;
}

grpc::ServerUnaryReactor* ModelRepositoryServiceImpl::UnloadModel(
    grpc::CallbackServerContext* context,
    const detlogp::v1::UnloadModelRequest* request,
    detlogp::v1::UnloadModelResponse* /*response*/) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) {
    return FinishNow(context, "UnloadModel", denied);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  tasks_.Start([this, reactor, model = request->model(),
                version = request->model_version()]() {
    const absl::Status status = manager_->Unload(model, version);
    reactor->Finish(Record("UnloadModel", ToGrpcStatus(status)));
  });
  return reactor;
}

// ---------------------------------------------------------------- upload

// Reads the header, then chunks. A worker thread (one per upload) hashes
// each chunk, copies it into the weights and writes it under --model_root
// while the next chunks arrive; reading pauses when max_pending_upload_chunks
// wait. Once the worker has started, it alone finishes the call, as its last
// act, so the reactor is never deleted under it.
class ModelRepositoryServiceImpl::UploadCall final
    : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  UploadCall(ModelRepositoryServiceImpl* service, grpc::ByteBuffer* response,
             std::string authorization,
             std::chrono::system_clock::time_point deadline)
      : service_(service),
        response_(response),
        authorization_(std::move(authorization)),
        deadline_(deadline) {
    absl::MutexLock lock(&mu_);
    reading_ = true;
    StartRead(&received_message_);
  }

  void OnReadDone(bool ok) override {
    std::optional<absl::Status> finish_now;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (finished_) return;
      ReceivedUploadMessage message;
      if (ok) {
        message =
            ReadUploadMessage(&received_message_, forwarding_ && !forward_end_);
      }
      if (!worker_started_) {
        finish_now =
            ok ? StartFromHeaderLocked(message)
               : (cancelled_ ? absl::CancelledError("upload cancelled")
                             : v1::FieldError(
                                   absl::StatusCode::kInvalidArgument, "header",
                                   "the stream ended before the header"));
        if (finish_now->ok()) {
          finish_now.reset();
          ContinueReadingLocked();
        } else {
          finished_ = true;
          result_ = *finish_now;
        }
      } else if (!ok) {
        forward_end_ = true;
        PushLocalLocked(Item{Item::kEnd});
      } else {
        AcceptLocked(std::move(message));
      }
    }
    if (finish_now.has_value()) Finish(ToGrpcStatus(*finish_now));
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    forward_abort_ = true;
    if (worker_started_) {
      PushLocalLocked(
          Item{Item::kAbort, {}, absl::CancelledError("upload cancelled")});
    }
  }

  // The outcome is logged and counted here, once every reaction has run: a
  // client's cancel reaches the worker first as a failed read (the end of
  // the stream) and only then as OnCancel, so the worker may have finished
  // with "the upload ended after N of M bytes" for what was a cancel.
  void OnDone() override {
    absl::Status result;
    bool worker_started;
    {
      absl::MutexLock lock(&mu_);
      result = cancelled_ && !result_.ok()
                   ? absl::CancelledError("upload cancelled")
                   : result_;
      worker_started = worker_started_;
    }
    if (worker_started && !result.ok()) {
      spdlog::warn("upload of {} refused: {}", model_, result.ToString());
    }
    service_->Record("UploadModel", ToGrpcStatus(result));
    delete this;
  }

 private:
  struct Item {
    enum Kind { kChunk, kEnd, kAbort } kind;
    // A chunk's bytes where they arrived, shared with the forwarded message
    // of a chain push.
    std::shared_ptr<const UploadChunkBytes> bytes;
    absl::Status status;
  };

  absl::Status StartFromHeaderLocked(const ReceivedUploadMessage& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!message.status.ok()) return message.status;
    if (message.part != UploadModelRequest::kHeader) {
      return v1::FieldError(
          absl::StatusCode::kInvalidArgument, "header",
          "the first message of an upload must carry the header");
    }
    const UploadModelHeader& header = message.message.header();
    auto shape = ValidateUploadHeader(header);
    if (!shape.ok()) return shape.status();
    if (absl::Status s = service_->manager_->CheckVersionNumber(
            header.model(), header.model_version());
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("header.", s.message()));
    }
    // Before any bytes are taken; AddVersion checks again at the end.
    if (absl::Status s = service_->manager_->CheckShape(
            header.model(), shape->hidden_size, shape->vocab_size);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("header.", s.message()));
    }
    shape_ = *shape;
    model_ = header.model();
    version_ = header.model_version();
    stage_ = header.stage();
    expected_sha256_ = header.weights_sha256();
    if (header.encoding() == detlogp::v1::UPLOAD_ENCODING_XOR_ZSTD) {
      if (absl::Status s = FindBaseLocked(header); !s.ok()) return s;
    }
    // Before any bytes are taken.
    auto reservation = service_->manager_->Reserve(
        shape_.hidden_size, shape_.padded_vocab_size, shape_.has_bias);
    if (!reservation.ok()) return reservation.status();
    reservation_ = *std::move(reservation);
    ModelStore* store = service_->options_.store;
    if (store != nullptr && store->writable()) {
      auto writer =
          store->BeginUpload(model_, shape_.hidden_size, shape_.vocab_size,
                             shape_.padded_vocab_size, shape_.has_bias);
      if (!writer.ok()) return writer.status();
      writer_ = *std::move(writer);
    }
    // Hashing and writing run beside the copy, block by block.
    assembler_ = std::make_unique<UploadAssembler>(shape_, writer_.get());
    from_peer_ = header.forwarded();
    if (header.forward_to_size() > 0) StartForwardingLocked(header);
    worker_started_ = true;
    service_->tasks_.Start([this] { Work(); });
    return absl::OkStatus();
  }

  // A chain push: the same messages go on to the next server as they
  // arrive, its header naming the servers after it.
  void StartForwardingLocked(const UploadModelHeader& header)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    forward_target_ = header.forward_to(0);
    UploadModelRequest next;
    *next.mutable_header() = header;
    next.mutable_header()->mutable_forward_to()->DeleteSubrange(0, 1);
    next.mutable_header()->set_forwarded(true);
    forward_queue_.push_back(EncodeUploadMessage(next));
    forwarding_ = true;
    service_->tasks_.Start([this] { Forward(); });
  }

  // The forwarding thread: writes the queued messages to the next server;
  // a server that stops reading is drained (its refusal is logged, and the
  // pusher learns who holds the version by asking each server).
  void Forward() {
    const auto channel = grpc::CreateChannel(
        forward_target_, service_->options_.peer_credentials != nullptr
                             ? service_->options_.peer_credentials
                             : grpc::InsecureChannelCredentials());
    grpc::ClientContext context;
    // The pusher's deadline bounds the whole chain.
    context.set_deadline(deadline_);
    if (!authorization_.empty()) {
      context.AddMetadata("authorization", authorization_);
    }
    UploadForwardStream stream(channel, &context);
    bool open = true;
    bool aborted = false;
    while (true) {
      grpc::ByteBuffer message;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &UploadCall::HasForwardWork));
        if (forward_abort_) {
          aborted = true;
          break;
        }
        if (forward_queue_.empty()) break;  // the stream ended
        message = std::move(forward_queue_.front());
        forward_queue_.pop_front();
        if (!reading_) ContinueReadingLocked();
      }
      if (open) open = stream.Write(message);
    }
    if (aborted) {
      context.TryCancel();
    } else if (open) {
      stream.WritesDone();
    }
    ModelVersionStatus response;
    const grpc::Status status = stream.Finish(&response);
    if (status.ok()) {
      spdlog::info("upload of {} forwarded to {}: version {} published there",
                   model_, forward_target_, response.version());
    } else {
      spdlog::warn("upload of {} forwarded to {}: {} {}", model_,
                   forward_target_, static_cast<int>(status.error_code()),
                   status.error_message());
    }
    absl::MutexLock lock(&mu_);
    forward_queue_.clear();
    forwarding_ = false;
  }

  bool HasForwardWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return forward_abort_ || forward_end_ || !forward_queue_.empty();
  }
  bool ForwardingDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !forwarding_;
  }

  // Queues an item for the local worker, unless it has stopped consuming.
  void PushLocalLocked(Item item) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!local_done_) queue_.push_back(std::move(item));
  }

  // The base a delta names: a ready version with the digest the pusher
  // stated and the same shape. Its host bytes are taken now when the backend
  // keeps them, else read by the worker (ReadBase) from the placed model (a
  // GPU's copy) or from --model_root.
  absl::Status FindBaseLocked(const UploadModelHeader& header)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t number = header.base_version();
    auto base = service_->manager_->Resolve(header.model(), number);
    if (!base.ok()) {
      return BaseMissing(
          number, absl::StrCat("model '", header.model(),
                               "' has no ready version ", number, " here"));
    }
    const ServedVersion& version = **base;
    if (version.weights_sha256 != header.base_weights_sha256()) {
      return BaseMissing(
          number, absl::StrCat("version ", number, " here holds weights ",
                               version.weights_sha256, ", not ",
                               header.base_weights_sha256()));
    }
    if (version.hidden_size != shape_.hidden_size ||
        version.padded_vocab_size != shape_.padded_vocab_size ||
        version.has_bias != shape_.has_bias) {
      return BaseMissing(number, absl::StrCat("version ", number,
                                              " has another shape "
                                              "or bias than the header"));
    }
    base_weights_ = version.host_weights.lock();
    // A read of no bytes says whether the placed model reads back.
    const bool reads_back = version.placed != nullptr &&
                            version.placed->ReadWeights(0, 0, nullptr).ok();
    if (base_weights_ == nullptr && !reads_back &&
        service_->options_.store == nullptr) {
      return BaseMissing(number,
                         absl::StrCat("version ", number,
                                      " is held only on the device, which "
                                      "does not read it back, and this "
                                      "server keeps no --model_root"));
    }
    base_version_ = *std::move(base);  // keeps it from being freed meanwhile
    delta_ = true;
    return absl::OkStatus();
  }

  // The base's host bytes, for a backend that keeps none: read from
  // wherever the server holds the version (VersionBytes: the placed model,
  // else its files).
  absl::Status ReadBase() {
    if (base_weights_ != nullptr) return absl::OkStatus();
    const ServedVersion& base = *base_version_;
    auto bytes = VersionBytes::Open(
        base, [this, &base] { return service_->FileWeightsOf(base); });
    if (!bytes.ok()) {
      return BaseMissing(base.version, absl::StrCat("version ", base.version,
                                                    " could not be read here: ",
                                                    bytes.status().message()));
    }
    auto weights = (*bytes)->Weights(base);
    if (!weights.ok()) {
      return BaseMissing(
          base.version,
          absl::StrCat("version ", base.version, " could not be read here (",
                       (*bytes)->source(), "): ", weights.status().message()));
    }
    spdlog::info("delta upload: base version {} of '{}' read from its {}",
                 base.version, model_, (*bytes)->source());
    base_weights_ = *std::move(weights);
    return absl::OkStatus();
  }

  void AcceptLocked(ReceivedUploadMessage message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // A chain forwards every message as it came, even one refused here:
    // the next server judges it for itself. A chunk's bytes stay where
    // they arrived, shared by the local queue and the forwarded message.
    if (forwarding_ && !forward_end_) {
      forward_queue_.emplace_back();
      forward_queue_.back().Swap(&message.forward);  // no copy of a buffer
    }
    if (!message.status.ok()) {
      PushLocalLocked(Item{Item::kAbort, {}, std::move(message.status)});
      return;
    }
    switch (message.part) {
      case UploadModelRequest::kChunk: {
        const int64_t size = message.chunk->size;
        if (service_->options_.on_upload_bytes) {
          service_->options_.on_upload_bytes(from_peer_ ? "peer" : "pusher",
                                             size);
        }
        if (trailer_seen_) {
          PushLocalLocked(
              Item{Item::kAbort,
                   {},
                   v1::FieldError(absl::StatusCode::kInvalidArgument,
                                  "weights_sha256",
                                  "the digest message must be the last one")});
          return;
        }
        const int64_t payload_bytes =
            shape_.weight_bytes() + shape_.bias_bytes();
        if (received_ + size >
            (delta_ ? v1::MaxXorDeltaBytes(payload_bytes) : payload_bytes)) {
          PushLocalLocked(Item{
              Item::kAbort,
              {},
              v1::FieldError(
                  absl::StatusCode::kInvalidArgument, "chunk",
                  absl::StrCat("more bytes than the header announced (",
                               (shape_.weight_bytes() + shape_.bias_bytes()),
                               " = weight [", shape_.padded_vocab_size, ", ",
                               shape_.hidden_size, "] bf16",
                               shape_.has_bias ? " + bias fp32" : "", ")"))});
          return;
        }
        received_ += size;
        PushLocalLocked(Item{Item::kChunk, std::move(message.chunk)});
        break;
      }
      case UploadModelRequest::kWeightsSha256:
        if (!expected_sha256_.empty() || trailer_seen_) {
          PushLocalLocked(
              Item{Item::kAbort,
                   {},
                   v1::FieldError(absl::StatusCode::kInvalidArgument,
                                  "weights_sha256",
                                  "sent twice (header and last message)")});
          return;
        }
        if (!IsHexDigest(message.message.weights_sha256())) {
          PushLocalLocked(
              Item{Item::kAbort,
                   {},
                   v1::FieldError(absl::StatusCode::kInvalidArgument,
                                  "weights_sha256",
                                  "expected 64 lowercase hex digits")});
          return;
        }
        trailer_seen_ = true;
        expected_sha256_ = message.message.weights_sha256();
        break;
      default:
        PushLocalLocked(
            Item{Item::kAbort,
                 {},
                 v1::FieldError(
                     absl::StatusCode::kInvalidArgument, "header",
                     "sent twice; an upload has one header, then chunks")});
        return;
    }
    ContinueReadingLocked();
  }

  void ContinueReadingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Not past the end of the stream, nor after Finish.
    if (reading_ || finished_ || forward_end_) return;
    const int limit = service_->options_.max_pending_upload_chunks;
    if (static_cast<int>(queue_.size()) < limit &&
        static_cast<int>(forward_queue_.size()) < limit) {
      reading_ = true;
      StartRead(&received_message_);
    }
  }

  bool HasItem() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty();
  }

  // The upload's thread: consumes chunks, then finalizes and finishes.
  void Work() {
    absl::Status status = Consume();
    if (status.ok()) status = Publish();
    // Dropped before Finish: a refused upload frees its memory and removes
    // its temporary files before the client hears of it.
    assembler_.reset();  // before the writer it writes to
    writer_.reset();
    reservation_ = {};
    {
      absl::MutexLock lock(&mu_);
      // The rest of a chain still needs the stream: keep reading for it,
      // and answer once it has answered.
      local_done_ = true;
      queue_.clear();
      if (forwarding_) ContinueReadingLocked();
      mu_.Await(absl::Condition(this, &UploadCall::ForwardingDone));
      finished_ = true;
      result_ = status;
    }
    Finish(ToGrpcStatus(status));
  }

  absl::Status Consume() {
    const absl::Time start = absl::Now();
    std::unique_ptr<v1::XorDeltaDecoder> decoder;
    if (delta_) {
      if (absl::Status s = ReadBase(); !s.ok()) return s;
      decoder = std::make_unique<v1::XorDeltaDecoder>(
          v1::PayloadParts{absl::string_view(reinterpret_cast<const char*>(
                                                 base_weights_->weight.data()),
                                             base_weights_->weight.size() * 2),
                           absl::string_view(reinterpret_cast<const char*>(
                                                 base_weights_->bias.data()),
                                             base_weights_->bias.size() * 4)},
          assembler_->total_bytes());
    }
    const auto append = [this](const char* bytes, size_t size) {
      return assembler_->Append(bytes, size);
    };
    while (true) {
      Item item;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &UploadCall::HasItem));
        item = std::move(queue_.front());
        queue_.pop_front();
        if (!reading_ && !finished_ && item.kind == Item::kChunk) {
          ContinueReadingLocked();
        }
      }
      if (item.kind == Item::kAbort) return item.status;
      if (item.kind == Item::kEnd) break;
      for (absl::string_view span : item.bytes->spans) {
        absl::Status s = decoder != nullptr
                             ? decoder->Feed(span.data(), span.size(), append)
                             : append(span.data(), span.size());
        if (!s.ok()) return s;
      }
    }
    if (decoder != nullptr) {
      if (absl::Status s = decoder->Finish(); !s.ok()) return s;
      base_weights_.reset();  // its memory is not needed past here
      base_version_.reset();
    }
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return absl::CancelledError("upload cancelled");
      if (expected_sha256_.empty() &&
          assembler_->received_bytes() == assembler_->total_bytes()) {
        return v1::FieldError(absl::StatusCode::kInvalidArgument,
                              "weights_sha256",
                              "neither the header nor the last message carried "
                              "it");
      }
    }
    auto digest = assembler_->Finish();
    if (!digest.ok()) return digest.status();
    digest_ = *std::move(digest);
    spdlog::info(
        "upload of {}: {} bytes {}, hashed and written in {:.3f} s after the "
        "header",
        model_, assembler_->total_bytes(),
        delta_ ? "rebuilt from a delta" : "received",
        absl::ToDoubleSeconds(absl::Now() - start));
    return absl::OkStatus();
  }

  absl::Status Publish() {
    const std::string& digest = digest_;
    if (digest != expected_sha256_) {
      return v1::FieldError(
          absl::StatusCode::kDataLoss, "weights_sha256",
          absl::StrCat("the client said ", expected_sha256_,
                       " but the bytes received hash to ", digest));
    }
    std::shared_ptr<LmHeadWeights> weights = assembler_->TakeWeights();
    weights->description = absl::StrCat("upload of ", model_);
    assembler_.reset();  // done with the writer
    VersionOrigin origin;
    origin.description = "upload";
    origin.version = version_;
    if (writer_ != nullptr) {
      // Owns the writer: a staged version is persisted at its commit, or
      // its temporary files go with it.
      origin.persist =
          [writer = std::shared_ptr<VersionWriter>(std::move(writer_)),
           digest](int64_t version) { return writer->Commit(version, digest); };
    }
    auto added = stage_ ? service_->manager_->StageVersion(
                              model_, std::move(weights), std::move(origin),
                              std::move(reservation_))
                        : service_->manager_->AddVersion(
                              model_, std::move(weights), std::move(origin),
                              std::move(reservation_));
    if (!added.ok()) return added.status();
    bool own_buffer = false;
    const grpc::Status written =
        grpc::SerializationTraits<ModelVersionStatus>::Serialize(
            *added, response_, &own_buffer);
    if (!written.ok()) {
      return absl::InternalError(
          absl::StrCat("ModelVersionStatus: cannot be written (",
                       written.error_message(), ")"));
    }
    return absl::OkStatus();
  }

  ModelRepositoryServiceImpl* const service_;
  grpc::ByteBuffer* const response_;

  absl::Mutex mu_;
  grpc::ByteBuffer received_message_ ABSL_GUARDED_BY(mu_);
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_started_ ABSL_GUARDED_BY(mu_) = false;
  bool trailer_seen_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status result_ ABSL_GUARDED_BY(mu_);  // what Finish sent
  int64_t received_ ABSL_GUARDED_BY(mu_) = 0;
  // Set from the header (under mu_), then used by the worker alone.
  std::string expected_sha256_;
  digests::LmHeadShape shape_;
  std::string model_;
  int64_t version_ = 0;  // 0: the model's next number
  bool stage_ = false;   // two-phase: hold it STAGED until a commit
  // A chain push: the next server, and the messages still to send it (wire
  // bytes; a chunk's shared with the local queue).
  const std::string authorization_;  // the call's, sent on with it
  const std::chrono::system_clock::time_point deadline_;  // the call's
  std::string forward_target_;
  bool from_peer_ = false;  // the header said `forwarded`
  std::deque<grpc::ByteBuffer> forward_queue_ ABSL_GUARDED_BY(mu_);
  bool forwarding_ ABSL_GUARDED_BY(mu_) = false;     // Forward() runs
  bool forward_end_ ABSL_GUARDED_BY(mu_) = false;    // the stream ended
  bool forward_abort_ ABSL_GUARDED_BY(mu_) = false;  // the call was cancelled
  bool local_done_ ABSL_GUARDED_BY(mu_) = false;     // the worker stopped
  // A delta upload: its base, held until the payload is rebuilt.
  bool delta_ = false;
  std::shared_ptr<const ServedVersion> base_version_;
  std::shared_ptr<const LmHeadWeights> base_weights_;
  ModelManager::Reservation reservation_;
  std::unique_ptr<VersionWriter> writer_;
  // Declared after the writer it writes to: destroyed first.
  std::unique_ptr<UploadAssembler> assembler_;
  std::string digest_;
};

grpc::ServerReadReactor<grpc::ByteBuffer>*
ModelRepositoryServiceImpl::UploadModel(grpc::CallbackServerContext* context,
                                        grpc::ByteBuffer* response) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) {
    return new RejectedCall<grpc::ServerReadReactor<grpc::ByteBuffer>>(
        Record("UploadModel", denied));
  }
  // A chain push forwards the call's authorization to the next server.
  std::string authorization;
  const auto& metadata = context->client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization.assign(it->second.data(), it->second.size());
  }
  return new UploadCall(this, response, std::move(authorization),
                        context->deadline());
}

}  // namespace detlogp::server
