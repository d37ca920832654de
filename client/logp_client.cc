#include "client/logp_client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"

namespace detlogp::client {

detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, std::string data, const std::vector<int64_t>& targets,
    const LogProbOptions& options) {
  detlogp::v1::LogProbRequest request;
  request.set_request_id(std::move(request_id));
  detlogp::v1::Tensor* hidden = request.mutable_hidden();
  hidden->set_dtype(dtype);
  hidden->add_shape(rows);
  hidden->add_shape(hidden_size);
  hidden->set_data(std::move(data));
  request.mutable_target_ids()->Add(targets.begin(), targets.end());
  request.set_temperature(options.temperature);
  request.set_return_lse(options.return_lse);
  request.set_return_entropy(options.return_entropy);
  request.set_top_k(options.top_k);
  request.set_model(options.model);
  request.set_model_version(options.model_version);
  return request;
}

detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, std::string data, const std::vector<int64_t>& targets,
    float temperature, bool return_lse, std::string model,
    int64_t model_version) {
  LogProbOptions options;
  options.temperature = temperature;
  options.return_lse = return_lse;
  options.model = std::move(model);
  options.model_version = model_version;
  return MakeLogProbRequest(std::move(request_id), dtype, rows, hidden_size,
                            std::move(data), targets, options);
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

namespace {

// DATA_LOSS naming `field` unless it holds `want` values.
absl::Status CheckSize(absl::string_view field, int64_t got, int64_t want,
                       absl::string_view why) {
  if (got == want) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(field, ": the response holds ", got,
                                          " values, expected ", want, " (", why,
                                          ")"));
}

}  // namespace

absl::Status CheckLogProbResponse(
    const detlogp::v1::LogProbRequest& request,
    const detlogp::v1::LogProbResponse& response) {
  const int64_t rows = request.target_ids_size();
  const std::string per_row = absl::StrCat(rows, " rows");
  absl::Status status =
      CheckSize("logprobs", response.logprobs_size(), rows, per_row);
  if (status.ok()) {
    status =
        CheckSize("lse", response.lse_size(), request.return_lse() ? rows : 0,
                  request.return_lse() ? per_row : "return_lse not set");
  }
  if (status.ok()) {
    status = CheckSize(
        "entropy", response.entropy_size(), request.return_entropy() ? rows : 0,
        request.return_entropy() ? per_row : "return_entropy not set");
  }
  const int64_t k = std::max<int64_t>(request.top_k(), 0);
  const std::string per_top = k > 0 ? absl::StrCat(rows, " rows x top_k ", k)
                                    : std::string("top_k not set");
  if (status.ok()) {
    status = CheckSize("top_ids", response.top_ids_size(), rows * k, per_top);
  }
  if (status.ok()) {
    status = CheckSize("top_logprobs", response.top_logprobs_size(), rows * k,
                       per_top);
  }
  return status;
}

ScoreResult ToScoreResult(const detlogp::v1::LogProbResponse& response) {
  ScoreResult result;
  result.request_id = response.request_id();
  result.logprobs.assign(response.logprobs().begin(),
                         response.logprobs().end());
  result.lse.assign(response.lse().begin(), response.lse().end());
  result.entropy.assign(response.entropy().begin(), response.entropy().end());
  result.top_ids.assign(response.top_ids().begin(), response.top_ids().end());
  result.top_logprobs.assign(response.top_logprobs().begin(),
                             response.top_logprobs().end());
  if (!result.logprobs.empty()) {
    result.top_k =
        static_cast<int64_t>(result.top_ids.size() / result.logprobs.size());
  }
  result.determinism_key = response.determinism_key();
  result.model = response.model();
  result.model_version = response.model_version();
  return result;
}

absl::StatusOr<ScoreResult> ToScoreResult(
    const detlogp::v1::LogProbRequest& request,
    const detlogp::v1::LogProbResponse& response) {
  if (absl::Status status = CheckLogProbResponse(request, response);
      !status.ok()) {
    return status;
  }
  ScoreResult result = ToScoreResult(response);
  result.top_k = std::max<int64_t>(request.top_k(), 0);
  return result;
}

std::shared_ptr<grpc::Channel> MakeChannel(const LogpClient::Options& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (options.own_connection)
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!options.load_balancing_policy.empty()) {
    args.SetLoadBalancingPolicyName(options.load_balancing_policy);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (!options.tls_root_certs.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs;
    ssl.pem_cert_chain = options.tls_client_cert;
    ssl.pem_private_key = options.tls_client_key;
    credentials = grpc::SslCredentials(ssl);
  }
  return grpc::CreateCustomChannel(options.target, credentials, args);
}

LogpClient::LogpClient(const Options& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<LogpClient>> LogpClient::Create(
    const Options& options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("client: empty target");
  }
  std::unique_ptr<LogpClient> client(new LogpClient(options));
  client->channel_ = MakeChannel(options);
  client->stub_ = detlogp::v1::LogProbService::NewStub(client->channel_);
  client->projection_stub_ =
      detlogp::v1::ProjectionService::NewStub(client->channel_);
  client->projection_ =
      std::make_unique<ProjectionConnection>(client->channel_);
  return client;
}

void LogpClient::PrepareContext(grpc::ClientContext* context) const {
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!options_.bearer_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
}

absl::StatusOr<detlogp::v1::ModelInfo> LogpClient::GetModelInfo(
    const std::string& model, int64_t model_version) {
  grpc::ClientContext context;
  PrepareContext(&context);
  detlogp::v1::GetModelInfoRequest request;
  request.set_model(model);
  request.set_model_version(model_version);
  detlogp::v1::ModelInfo info;
  grpc::Status status = stub_->GetModelInfo(&context, request, &info);
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<ScoreResult> LogpClient::Score(
    const detlogp::v1::LogProbRequest& request) {
  grpc::ClientContext context;
  PrepareContext(&context);
  detlogp::v1::LogProbResponse response;
  grpc::Status status = stub_->ComputeLogProbs(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return ToScoreResult(request, response);
}

absl::StatusOr<std::vector<ScoreResult>> LogpClient::ScoreStream(
    const std::vector<detlogp::v1::LogProbRequest>& requests) {
  grpc::ClientContext context;
  PrepareContext(&context);
  auto stream = stub_->StreamLogProbs(&context);
  // Writes on one thread while this one reads, so the server can pipeline.
  std::thread writer([&] {
    for (const auto& request : requests) {
      if (!stream->Write(request)) break;
    }
    stream->WritesDone();
  });
  std::vector<ScoreResult> results;
  absl::Status problem;
  detlogp::v1::LogProbResponse response;
  while (stream->Read(&response)) {
    if (!problem.ok()) continue;  // drain, so that Finish can return
    if (results.size() >= requests.size()) {
      problem = absl::DataLossError(absl::StrCat(
          "stream answered more than the ", requests.size(), " requests sent"));
      continue;
    }
    absl::StatusOr<ScoreResult> result =
        ToScoreResult(requests[results.size()], response);
    if (!result.ok()) {
      problem =
          absl::Status(result.status().code(),
                       absl::StrCat(result.status().message(),
                                    " [stream answer ", results.size(), "]"));
      continue;
    }
    results.push_back(*std::move(result));
  }
  writer.join();
  grpc::Status status = stream->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!problem.ok()) return problem;
  if (results.size() != requests.size()) {
    return absl::DataLossError(absl::StrCat("stream answered ", results.size(),
                                            " of ", requests.size(),
                                            " requests"));
  }
  return results;
}

}  // namespace detlogp::client
