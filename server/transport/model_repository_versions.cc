// ModelRepositoryService's version calls beside uploads: the two-phase
// publish's commit and abort, and DownloadModel (a peer's pull).
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"
#include "server/models/version_bytes.h"
#include "server/transport/grpc_status.h"
#include "server/transport/model_repository_service.h"
#include "server/transport/rejected_call.h"
#include "spdlog/spdlog.h"

namespace detlogp::server {

using detlogp::v1::ModelVersionStatus;
using detlogp::v1::UploadModelRequest;

grpc::ServerUnaryReactor* ModelRepositoryServiceImpl::CommitVersion(
    grpc::CallbackServerContext* context,
    const detlogp::v1::CommitVersionRequest* request,
    ModelVersionStatus* response) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) {
    return FinishNow(context, "CommitVersion", denied);
  }
  // Off the gRPC thread: a commit persists the version (an fsync).
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  tasks_.Start([this, reactor, response, model = request->model(),
                version = request->model_version(),
                digest = request->weights_sha256()]() {
    auto committed = manager_->CommitVersion(model, version, digest);
    if (committed.ok()) *response = *std::move(committed);
    reactor->Finish(Record("CommitVersion", ToGrpcStatus(committed.status())));
  });
  return reactor;
}

grpc::ServerUnaryReactor* ModelRepositoryServiceImpl::AbortVersion(
    grpc::CallbackServerContext* context,
    const detlogp::v1::AbortVersionRequest* request,
    detlogp::v1::AbortVersionResponse* /*response*/) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) {
    return FinishNow(context, "AbortVersion", denied);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  tasks_.Start([this, reactor, model = request->model(),
                version = request->model_version()]() {
    const absl::Status status = manager_->AbortVersion(model, version);
    reactor->Finish(Record("AbortVersion", ToGrpcStatus(status)));
  });
  return reactor;
}

absl::StatusOr<std::shared_ptr<const LmHeadWeights>>
ModelRepositoryServiceImpl::FileWeightsOf(const ServedVersion& version) const {
  if (options_.store != nullptr) {
    const auto versions = options_.store->ListVersions();
    if (auto model = versions.find(version.model); model != versions.end()) {
      for (const StoredVersion& stored : model->second) {
        if (stored.version != version.version) continue;
        auto weights = LoadLmHead(stored.source);
        if (!weights.ok()) return weights.status();
        if (weights->sha256 == version.weights_sha256) {
          return std::make_shared<const LmHeadWeights>(*std::move(weights));
        }
        return absl::DataLossError("its file no longer hashes to its digest");
      }
    }
  }
  return absl::NotFoundError("no files of it");
}

// Streams the header, then the weight and bias bytes in chunks, one write
// at a time (each OnWriteDone reads and starts the next). Holds the version
// and what its bytes are read from until done.
class ModelRepositoryServiceImpl::DownloadCall final
    : public grpc::ServerWriteReactor<UploadModelRequest> {
 public:
  DownloadCall(ModelRepositoryServiceImpl* service,
               std::shared_ptr<const ServedVersion> version,
               std::unique_ptr<VersionBytes> bytes)
      : service_(service),
        version_(std::move(version)),
        bytes_(std::move(bytes)) {
    auto* header = message_.mutable_header();
    header->set_model(version_->model);
    header->set_dtype(detlogp::v1::DTYPE_BFLOAT16);
    header->add_shape(version_->padded_vocab_size);
    header->add_shape(version_->hidden_size);
    header->set_vocab_size(version_->vocab_size);
    header->set_has_bias(version_->has_bias);
    header->set_weights_sha256(version_->weights_sha256);
    header->set_model_version(version_->version);
    StartWrite(&message_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      result_ = grpc::Status(grpc::StatusCode::CANCELLED, "download cancelled");
      Finish(result_);
      return;
    }
    const int64_t total = bytes_->total_bytes();
    if (offset_ >= total) {
      Finish(grpc::Status::OK);
      return;
    }
    // A chunk lies within the weight or within the bias.
    const int64_t end =
        offset_ < bytes_->weight_bytes() ? bytes_->weight_bytes() : total;
    const int64_t size =
        std::min(service_->options_.download_chunk_bytes, end - offset_);
    message_.clear_header();
    std::string* chunk = message_.mutable_chunk();
    chunk->resize(static_cast<size_t>(size));
    if (absl::Status read = bytes_->Read(offset_, size, chunk->data());
        !read.ok()) {
      result_ = ToGrpcStatus(absl::Status(
          read.code(), absl::StrCat("reading the version's bytes (",
                                    bytes_->source(), "): ", read.message())));
      Finish(result_);
      return;
    }
    offset_ += size;
    StartWrite(&message_);
  }

  void OnDone() override {
    service_->Record("DownloadModel", result_);
    delete this;
  }

 private:
  ModelRepositoryServiceImpl* const service_;
  const std::shared_ptr<const ServedVersion> version_;
  const std::unique_ptr<VersionBytes> bytes_;
  UploadModelRequest message_;
  int64_t offset_ = 0;  // payload bytes written so far
  grpc::Status result_;
};

grpc::ServerWriteReactor<UploadModelRequest>*
ModelRepositoryServiceImpl::DownloadModel(
    grpc::CallbackServerContext* context,
    const detlogp::v1::DownloadModelRequest* request) {
  using Rejected = RejectedCall<grpc::ServerWriteReactor<UploadModelRequest>>;
  if (grpc::Status denied = Authorize(*context); !denied.ok()) {
    return new Rejected(Record("DownloadModel", denied));
  }
  auto version = manager_->Resolve(request->model(), request->model_version());
  if (!version.ok()) {
    return new Rejected(
        Record("DownloadModel", ToGrpcStatus(version.status())));
  }
  const ServedVersion& served = **version;
  auto bytes = VersionBytes::Open(
      served, [this, &served] { return FileWeightsOf(served); });
  if (!bytes.ok()) {
    return new Rejected(Record("DownloadModel", ToGrpcStatus(bytes.status())));
  }
  return new DownloadCall(this, *std::move(version), *std::move(bytes));
}

}  // namespace detlogp::server
