#include "client/logp_client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace detlogp::client {

detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, std::string data, const std::vector<int64_t>& targets,
    float temperature, bool return_lse) {
  detlogp::v1::LogProbRequest request;
  request.set_request_id(std::move(request_id));
  detlogp::v1::Tensor* hidden = request.mutable_hidden();
  hidden->set_dtype(dtype);
  hidden->add_shape(rows);
  hidden->add_shape(hidden_size);
  hidden->set_data(std::move(data));
  for (int64_t target : targets) request.add_target_ids(target);
  request.set_temperature(temperature);
  request.set_return_lse(return_lse);
  return request;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

ScoreResult ToScoreResult(const detlogp::v1::LogProbResponse& response) {
  ScoreResult result;
  result.request_id = response.request_id();
  result.logprobs.assign(response.logprobs().begin(), response.logprobs().end());
  result.lse.assign(response.lse().begin(), response.lse().end());
  result.determinism_key = response.determinism_key();
  return result;
}

LogpClient::LogpClient(const Options& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<LogpClient>> LogpClient::Create(
    const Options& options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("client: empty target");
  }
  std::unique_ptr<LogpClient> client(new LogpClient(options));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  client->channel_ = grpc::CreateCustomChannel(
      options.target, grpc::InsecureChannelCredentials(), args);
  client->stub_ = detlogp::v1::LogProbService::NewStub(client->channel_);
  return client;
}

absl::StatusOr<detlogp::v1::ModelInfo> LogpClient::GetModelInfo() {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  detlogp::v1::ModelInfo info;
  grpc::Status status =
      stub_->GetModelInfo(&context, detlogp::v1::GetModelInfoRequest(), &info);
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<ScoreResult> LogpClient::Score(
    const detlogp::v1::LogProbRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  detlogp::v1::LogProbResponse response;
  grpc::Status status = stub_->ComputeLogProbs(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return ToScoreResult(response);
}

absl::StatusOr<std::vector<ScoreResult>> LogpClient::ScoreStream(
    const std::vector<detlogp::v1::LogProbRequest>& requests) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  auto stream = stub_->StreamLogProbs(&context);
  // Writes on one thread while this one reads, so the server can pipeline.
  std::thread writer([&] {
    for (const auto& request : requests) {
      if (!stream->Write(request)) break;
    }
    stream->WritesDone();
  });
  std::vector<ScoreResult> results;
  detlogp::v1::LogProbResponse response;
  while (stream->Read(&response)) results.push_back(ToScoreResult(response));
  writer.join();
  grpc::Status status = stream->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (results.size() != requests.size()) {
    return absl::DataLossError(absl::StrCat("stream answered ", results.size(),
                                            " of ", requests.size(),
                                            " requests"));
  }
  return results;
}

}  // namespace detlogp::client
