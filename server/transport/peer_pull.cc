#include "server/transport/peer_pull.h"

#include <memory>
#include <utility>

#include <grpcpp/create_channel.h>

#include "absl/strings/str_cat.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "server/models/upload_assembler.h"
#include "spdlog/spdlog.h"

namespace detlogp::server {
namespace {

using detlogp::v1::ListModelsResponse;
using detlogp::v1::ModelRepositoryService;

void Prepare(const PeerPullOptions& options, absl::Duration timeout,
             grpc::ClientContext* context) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!options.admin_token.empty()) {
    context->AddMetadata("authorization",
                         absl::StrCat("Bearer ", options.admin_token));
  }
}

// The latest ready version of `model` in a ListModels answer (0: none).
int64_t LatestOf(const ListModelsResponse& models, const std::string& model) {
  for (const auto& info : models.models()) {
    if (info.model() == model) return info.model_version();
  }
  return 0;
}

// Downloads `model` version `version` from `stub` and publishes it here.
absl::Status PullVersion(const PeerPullOptions& options,
                         ModelRepositoryService::Stub* stub,
                         const std::string& model, int64_t version,
                         ModelManager* manager, ModelStore* store) {
  grpc::ClientContext context;
  Prepare(options, options.download_timeout, &context);
  detlogp::v1::DownloadModelRequest request;
  request.set_model(model);
  request.set_model_version(version);
  auto reader = stub->DownloadModel(&context, request);
  detlogp::v1::UploadModelRequest message;
  if (!reader->Read(&message) || !message.has_header()) {
    const grpc::Status status = reader->Finish();
    return absl::UnavailableError(absl::StrCat(
        "download of ", model, " v", version, ": ", status.error_message()));
  }
  const detlogp::v1::UploadModelHeader header = message.header();
  if (header.shape_size() != 2) {
    return absl::DataLossError("download: the header has no [V, H] shape");
  }
  digests::LmHeadShape shape;
  shape.padded_vocab_size = header.shape(0);
  shape.hidden_size = header.shape(1);
  shape.vocab_size = header.vocab_size();
  shape.has_bias = header.has_bias();
  auto reservation = manager->Reserve(shape.hidden_size,
                                      shape.padded_vocab_size, shape.has_bias);
  if (!reservation.ok()) return reservation.status();
  std::unique_ptr<VersionWriter> writer;
  if (store != nullptr && store->writable()) {
    auto begun = store->BeginUpload(model, shape.hidden_size, shape.vocab_size,
                                    shape.padded_vocab_size, shape.has_bias);
    if (!begun.ok()) return begun.status();
    writer = *std::move(begun);
  }
  auto assembler = std::make_unique<UploadAssembler>(shape, writer.get());
  while (reader->Read(&message)) {
    if (!message.has_chunk()) continue;
    if (options.on_bytes) {
      options.on_bytes("peer", static_cast<int64_t>(message.chunk().size()));
    }
    if (absl::Status s =
            assembler->Append(message.chunk().data(), message.chunk().size());
        !s.ok()) {
      context.TryCancel();
      reader->Finish();
      return s;
    }
  }
  if (const grpc::Status status = reader->Finish(); !status.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "download of ", model, " v", version, ": ", status.error_message()));
  }
  auto digest = assembler->Finish();
  if (!digest.ok()) return digest.status();
  if (*digest != header.weights_sha256()) {
    return absl::DataLossError(absl::StrCat(
        "download of ", model, " v", version, ": the peer stated weights ",
        header.weights_sha256(), ", the bytes hash to ", *digest));
  }
  std::shared_ptr<LmHeadWeights> weights = assembler->TakeWeights();
  weights->description = absl::StrCat("pull of ", model);
  assembler.reset();  // done with the writer
  VersionOrigin origin;
  origin.description = "pull";
  origin.version = header.model_version();
  if (writer != nullptr) {
    origin.persist = [&writer, sha = *digest](int64_t number) {
      return writer->Commit(number, sha);
    };
  }
  auto added = manager->AddVersion(model, std::move(weights), std::move(origin),
                                   *std::move(reservation));
  return added.status();
}

}  // namespace

absl::StatusOr<PullReport> PullFromPeers(const PeerPullOptions& options,
                                         ModelManager* manager,
                                         ModelStore* store) {
  PullReport report;
  std::unique_ptr<ModelRepositoryService::Stub> best_stub;
  ListModelsResponse best;
  int64_t best_latest = 0;
  for (const std::string& peer : options.peers) {
    auto stub = ModelRepositoryService::NewStub(
        grpc::CreateChannel(peer, options.credentials != nullptr
                                      ? options.credentials
                                      : grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    Prepare(options, options.ask_timeout, &context);
    context.set_wait_for_ready(false);
    ListModelsResponse models;
    const grpc::Status status =
        stub->ListModels(&context, detlogp::v1::ListModelsRequest(), &models);
    if (!status.ok()) {
      spdlog::info("pull: peer {} not asked ({} {})", peer,
                   static_cast<int>(status.error_code()),
                   status.error_message());
      continue;
    }
    const int64_t latest = LatestOf(models, manager->default_model());
    if (latest > best_latest) {
      best_latest = latest;
      best = std::move(models);
      best_stub = std::move(stub);
      report.source = peer;
    }
  }
  if (best_stub == nullptr) {
    spdlog::info("pull: no peer serves model {}; serving what this server has",
                 manager->default_model());
    return report;
  }
  for (const auto& info : best.models()) {
    const int64_t ours = manager->NextVersion(info.model()) - 1;
    if (info.model_version() <= ours) continue;
    if (absl::Status s = PullVersion(options, best_stub.get(), info.model(),
                                     info.model_version(), manager, store);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("pull from ", report.source,
                                                 ": ", s.message()));
    }
    report.pulled.push_back(absl::StrCat(
        info.model(), " v", info.model_version(), " from ", report.source));
  }
  return report;
}

}  // namespace detlogp::server
