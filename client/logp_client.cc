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

absl::Status CheckLogProbResponse(const detlogp::v1::LogProbRequest& request,
                                  const detlogp::v1::LogProbResponse& response) {
  const int64_t rows = request.target_ids_size();
  const std::string per_row = absl::StrCat(rows, " rows");
  absl::Status status =
      CheckSize("logprobs", response.logprobs_size(), rows, per_row);
  if (status.ok()) {
    status = CheckSize("lse", response.lse_size(), request.return_lse() ? rows : 0,
                       request.return_lse() ? per_row : "return_lse not set");
  }
  if (status.ok()) {
    status = CheckSize("entropy", response.entropy_size(),
                       request.return_entropy() ? rows : 0,
                       request.return_entropy() ? per_row : "return_entropy not set");
  }
  const int64_t k = std::max<int64_t>(request.top_k(), 0);
  const std::string per_top =
      k > 0 ? absl::StrCat(rows, " rows x top_k ", k) : std::string("top_k not set");
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
  result.logprobs.assign(response.logprobs().begin(), response.logprobs().end());
  result.lse.assign(response.lse().begin(), response.lse().end());
  result.entropy.assign(response.entropy().begin(), response.entropy().end());
  result.top_ids.assign(response.top_ids().begin(), response.top_ids().end());
  result.top_logprobs.assign(response.top_logprobs().begin(),
                             response.top_logprobs().end());
  if (!result.logprobs.empty()) {
    result.top_k = static_cast<int64_t>(result.top_ids.size() / result.logprobs.size());
  }
  result.determinism_key = response.determinism_key();
  result.model = response.model();
  result.model_version = response.model_version();
  return result;
}

absl::StatusOr<ScoreResult> ToScoreResult(
    const detlogp::v1::LogProbRequest& request,
    const detlogp::v1::LogProbResponse& response) {
  if (absl::Status status = CheckLogProbResponse(request, response); !status.ok()) {
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
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
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

namespace {
// ProjectionService/Project's path (the generated stub's, which lives in a
// file-scope array of detlogp.grpc.pb.cc).
constexpr char kRawProjectMethod[] = "/detlogp.v1.ProjectionService/Project";
}  // namespace

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
  client->raw_project_method_ = std::make_unique<grpc::internal::RpcMethod>(
      kRawProjectMethod,
      grpc::internal::RpcMethod::SERVER_STREAMING, client->channel_);
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
      problem = absl::Status(result.status().code(),
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

absl::StatusOr<LogpClient::ProjectResult> LogpClient::Project(
    const std::vector<float>& x, int64_t rows, int64_t rows_per_chunk,
    bool keep_output,
    const std::function<void(detlogp::v1::ProjectResponse&)>& on_chunk) {
  constexpr int64_t kOut = 5376;
  ProjectOptions options;
  options.rows_per_chunk = rows_per_chunk;
  std::vector<float> y;
  if (keep_output && rows > 0 && static_cast<int64_t>(x.size()) == rows * 96) {
    y.resize(rows * kOut);
    options.y = y.data();
  }
  std::function<void(ProjectChunk&)> as_proto;
  if (on_chunk) {
    as_proto = [&](ProjectChunk& chunk) {
      detlogp::v1::ProjectResponse response = chunk.ToProto();
      on_chunk(response);
    };
  }
  absl::StatusOr<ProjectResult> result = ProjectChunks(x, rows, options, as_proto);
  if (result.ok()) result->y = std::move(y);
  return result;
}

namespace {

// OK when `chunk` is the next one of a FLOAT32 [rows, kOut] projection
// whose rows up to `next_row` have arrived; its row count in `chunk_rows`.
absl::Status CheckChunk(const ProjectChunk& chunk, int64_t next_row, int64_t rows,
                        int64_t out_dim, int64_t* chunk_rows) {
  if (chunk.row_offset != next_row) {
    return absl::DataLossError(absl::StrCat("ProjectResponse.row_offset: ",
                                            chunk.row_offset,
                                            ", expected the next row ", next_row));
  }
  if (chunk.y_dtype != detlogp::v1::DTYPE_FLOAT32) {
    return absl::DataLossError(absl::StrCat(
        "ProjectResponse.y.dtype: ", detlogp::v1::DType_Name(chunk.y_dtype),
        " at row ", next_row, ", expected DTYPE_FLOAT32"));
  }
  if (chunk.y_shape.size() != 2 || chunk.y_shape[0] <= 0 ||
      chunk.y_shape[1] != out_dim || chunk.y_shape[0] > rows - next_row) {
    std::string shape;
    for (int64_t d : chunk.y_shape) absl::StrAppend(&shape, shape.empty() ? "" : ", ", d);
    return absl::DataLossError(absl::StrCat(
        "ProjectResponse.y.shape: [", shape, "] at row ", next_row, ", expected [r, ",
        out_dim, "] with 0 < r <= ", rows - next_row, " (rows left)"));
  }
  *chunk_rows = chunk.y_shape[0];
  const int64_t want_bytes = *chunk_rows * out_dim * static_cast<int64_t>(sizeof(float));
  if (chunk.y_data_bytes != want_bytes) {
    return absl::DataLossError(absl::StrCat("ProjectResponse.y.data: ", chunk.y_data_bytes,
                                            " bytes at row ", next_row, ", expected ",
                                            want_bytes, " for ", *chunk_rows, " rows"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LogpClient::ProjectResult> LogpClient::ProjectChunks(
    const std::vector<float>& x, int64_t rows, const ProjectOptions& options,
    const std::function<void(ProjectChunk&)>& on_chunk) {
  constexpr int64_t kIn = 96, kOut = 5376;
  if (rows < 0 || static_cast<int64_t>(x.size()) != rows * kIn) {
    return absl::InvalidArgumentError("x must hold rows * 96 floats");
  }
  detlogp::v1::ProjectRequest request;
  request.set_request_id(options.request_id);
  request.set_rows_per_chunk(options.rows_per_chunk);
  detlogp::v1::Tensor* tensor = request.mutable_x();
  tensor->set_dtype(detlogp::v1::DTYPE_FLOAT32);
  tensor->add_shape(rows);
  tensor->add_shape(kIn);
  tensor->set_data(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
  grpc::ClientContext context;
  PrepareContext(&context);
  // The generated stub's reader, with gRPC's bytes as the message type: a
  // read swaps the received buffer in, nothing is parsed or copied.
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel_.get(), *raw_project_method_, &context, request));
  ProjectResult result;
  int64_t next_row = 0;
  grpc::ByteBuffer message;
  absl::Status problem;
  while (reader->Read(&message)) {
    absl::StatusOr<ProjectChunk> chunk = ParseProjectChunk(message);
    message.Clear();
    int64_t chunk_rows = 0;
    if (chunk.ok()) {
      problem = CheckChunk(*chunk, next_row, rows, kOut, &chunk_rows);
    } else {
      problem = absl::Status(chunk.status().code(),
                             absl::StrCat(chunk.status().message(), " (chunk at row ",
                                          next_row, ")"));
    }
    if (!problem.ok()) {
      context.TryCancel();
      break;
    }
    if (result.determinism_key.empty()) result.determinism_key = chunk->determinism_key;
    if (options.y != nullptr) chunk->CopyYTo(options.y + next_row * kOut);
    if (on_chunk) on_chunk(*chunk);
    next_row += chunk_rows;
    ++result.chunks;
  }
  if (!problem.ok()) {
    while (reader->Read(&message)) {
    }
  }
  const grpc::Status status = reader->Finish();
  if (!problem.ok()) return problem;
  if (!status.ok()) return FromGrpcStatus(status);
  if (next_row != rows) {
    return absl::DataLossError(absl::StrCat("projection stream ended at row ",
                                            next_row, " of ", rows));
  }
  return result;
}

}  // namespace detlogp::client
