#include "client/cli_models.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"

namespace detlogp::client {
namespace {

void PrintVersion(const detlogp::v1::ModelVersionStatus& v) {
  std::printf(
      "  version %lld %s H=%lld V=%lld V_pad=%lld bias=%d memory=%lld "
      "in_flight=%lld persisted=%d source=%s\n    weights_sha256 %s\n"
      "    determinism_key %s\n",
      static_cast<long long>(v.version()),
      detlogp::v1::ModelVersionStatus::State_Name(v.state()).c_str(),
      static_cast<long long>(v.hidden_size()),
      static_cast<long long>(v.vocab_size()),
      static_cast<long long>(v.padded_vocab_size()), v.has_bias() ? 1 : 0,
      static_cast<long long>(v.memory_bytes()),
      static_cast<long long>(v.requests_in_flight()), v.persisted() ? 1 : 0,
      v.source().c_str(), v.weights_sha256().c_str(),
      v.determinism_key().c_str());
}

}  // namespace

absl::Status RequireModel(const ModelsCommandOptions& options) {
  if (options.model.empty()) {
    return absl::InvalidArgumentError("--model is required");
  }
  return absl::OkStatus();
}

absl::Status RunModels(ModelRepositoryClient& client) {
  auto models = client.ListModels();
  if (!models.ok()) return models.status();
  for (const detlogp::v1::ModelInfo& info : models->models()) {
    std::printf("model %s latest %lld%s\n", info.model().c_str(),
                static_cast<long long>(info.model_version()),
                info.model() == models->default_model() ? " (default)" : "");
    for (const auto& version : info.versions()) PrintVersion(version);
  }
  return absl::OkStatus();
}

absl::Status RunLoad(ModelRepositoryClient& client,
                     const ModelsCommandOptions& options) {
  if (absl::Status s = RequireModel(options); !s.ok()) return s;
  if (options.path.empty()) {
    return absl::InvalidArgumentError(
        "--path is required (relative to the server's --model_root)");
  }
  detlogp::v1::LoadModelRequest request;
  request.set_model(options.model);
  request.set_path(options.path);
  request.set_lm_head_tensor(options.lm_head_tensor);
  request.set_bias_tensor(options.bias_tensor);
  request.set_vocab_size(options.vocab_size);
  request.set_expected_weights_sha256(options.expected_sha256);
  request.set_model_version(options.model_version);
  auto version = client.LoadModel(request);
  if (!version.ok()) return version.status();
  std::printf("model %s\n", request.model().c_str());
  PrintVersion(*version);
  return absl::OkStatus();
}

absl::Status RunUpload(const LogpClient::Options& connection,
                       const ModelRepositoryClient::Options& admin,
                       const ModelsCommandOptions& options) {
  if (absl::Status s = RequireModel(options); !s.ok()) return s;
  if (options.weights_file.empty()) {
    return absl::InvalidArgumentError("--weights_file is required");
  }
  std::string read_from;
  auto upload = ReadLmHeadUpload(options.model, options.weights_file,
                                 options.lm_head_tensor, options.bias_tensor,
                                 options.vocab_size, &read_from);
  if (!upload.ok()) return upload.status();
  std::fprintf(stderr, "lm_head: %s\n", read_from.c_str());
  upload->version = options.model_version;
  std::vector<std::string> servers = options.servers;
  if (servers.empty()) servers.push_back(connection.target);
  // A "dns:" server (a headless Service) is every address it resolves to.
  absl::StatusOr<std::vector<PushTarget>> fleet =
      ExpandPushTargets(servers, ResolveInPodOrder);
  if (!fleet.ok()) return fleet.status();
  PushOptions push;
  push.two_phase = options.two_phase;
  if (options.fanout == "chain" ||
      (options.fanout.empty() && fleet->size() > 2)) {
    push.fanout = PushOptions::Fanout::kChain;
  } else if (!options.fanout.empty() && options.fanout != "direct") {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "--fanout",
        absl::StrCat("'", options.fanout, "' is neither chain nor direct"));
  }
  absl::StatusOr<LmHeadDelta> delta;
  if (options.base_version != 0 || !options.base_weights_file.empty()) {
    if (options.base_version <= 0 || options.base_weights_file.empty()) {
      return v1::FieldError(absl::StatusCode::kInvalidArgument,
                            "--base_version",
                            "a delta needs --base_version (> 0) and "
                            "--base_weights_file, that version's weights");
    }
    auto base = ReadLmHeadUpload(options.model, options.base_weights_file,
                                 options.lm_head_tensor, options.bias_tensor,
                                 options.vocab_size);
    if (!base.ok()) return base.status();
    delta = EncodeLmHeadDelta(*upload, *base, options.base_version);
    if (!delta.ok()) return delta.status();
    std::fprintf(stderr, "delta against version %lld: %zu bytes (head %lld)\n",
                 static_cast<long long>(options.base_version),
                 delta->bytes.size(),
                 static_cast<long long>(upload->payload_bytes()));
    push.delta = &*delta;
  }
  const PushReport report =
      PushToFleet(*fleet, connection, admin, *upload, push);
  // "target": the server's address as gRPC names it.
  for (const PushedVersion& pushed : report.targets) {
    if (pushed.version.ok()) {
      std::printf(
          "target %s model %s version %lld weights_sha256 %s "
          "determinism_key %s %s %s %lld bytes\n",
          pushed.target.c_str(), upload->model.c_str(),
          static_cast<long long>(pushed.version->version()),
          pushed.version->weights_sha256().c_str(),
          pushed.version->determinism_key().c_str(),
          pushed.via_chain ? "via" : "sent",
          pushed.via_chain    ? "chain"
          : pushed.sent_delta ? "delta"
                              : "head",
          static_cast<long long>(pushed.bytes_sent));
    } else {
      std::printf("target %s error %s\n", pushed.target.c_str(),
                  pushed.version.status().ToString().c_str());
    }
  }
  if (report.committed) {
    // The skew window, as the servers' clocks saw it: from the first to the
    // last target serving the new version.
    int64_t first = 0, last = 0;
    for (const PushedVersion& pushed : report.targets) {
      if (!pushed.version.ok()) continue;
      const int64_t at = pushed.version->ready_unix_micros();
      first = first == 0 ? at : std::min(first, at);
      last = std::max(last, at);
    }
    std::printf(
        "committed on %zu targets; ready within %.3f ms of each other\n",
        report.targets.size(), (last - first) / 1e3);
  }
  return report.status;
}

absl::Status RunUnload(ModelRepositoryClient& client,
                       const ModelsCommandOptions& options) {
  if (absl::Status s = RequireModel(options); !s.ok()) return s;
  if (options.model_version <= 0) {
    return absl::InvalidArgumentError("--model_version is required (> 0)");
  }
  if (absl::Status s = client.UnloadModel(options.model, options.model_version);
      !s.ok()) {
    return s;
  }
  std::printf("model %s version %lld unloaded\n", options.model.c_str(),
              static_cast<long long>(options.model_version));
  return absl::OkStatus();
}

}  // namespace detlogp::client
