#include "client/model_repository_client.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/tensor_files.h"
#include "formats/checkpoint.h"
#include "kernels/bfloat16.h"
#include "digests/lm_head_digest.h"

namespace detlogp::client {
namespace {

using detlogp::v1::ModelVersionStatus;
using detlogp::v1::UploadModelRequest;

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

absl::StatusOr<ModelVersionStatus> ModelRepositoryClient::UploadModel(
    const LmHeadUpload& upload, const UploadHooks& hooks) {
  if (absl::Status s = ValidateLmHeadUpload(upload); !s.ok()) return s;
  grpc::ClientContext context;
  PrepareContext(&context);
  ModelVersionStatus response;
  std::unique_ptr<grpc::ClientWriter<UploadModelRequest>> writer =
      stub_->UploadModel(&context, &response);

  UploadModelRequest message;
  detlogp::v1::UploadModelHeader* header = message.mutable_header();
  header->set_model(upload.model);
  header->set_dtype(detlogp::v1::DTYPE_BFLOAT16);
  header->add_shape(upload.padded_vocab_size);
  header->add_shape(upload.hidden_size);
  header->set_vocab_size(upload.vocab_size);
  header->set_has_bias(!upload.bias.empty());
  header->set_model_version(upload.version);
  // Its blocks hash on every core in a fraction of the transfer's time, so
  // the digest travels in the header.
  const std::string digest = LmHeadUploadDigest(upload);
  header->set_weights_sha256(digest);
  // A failed write means the server has ended the call (e.g. the header was
  // refused); Finish says why.
  bool open = writer->Write(message);

  // The payload is the weight's bytes, then the bias's; a chunk may hold the
  // end of one and the start of the other.
  const char* parts[2] = {reinterpret_cast<const char*>(upload.weight.data()),
                          reinterpret_cast<const char*>(upload.bias.data())};
  const int64_t part_sizes[2] = {static_cast<int64_t>(upload.weight.size() * 2),
                                 static_cast<int64_t>(upload.bias.size() * 4)};
  const int64_t total = part_sizes[0] + part_sizes[1];
  int64_t sent = 0;
  bool cancelled = false;
  while (open && sent < total) {
    const int64_t size = std::min<int64_t>(options_.chunk_bytes, total - sent);
    std::string* chunk = message.mutable_chunk();
    chunk->clear();
    chunk->reserve(size);
    for (int part = 0, begin = 0; part < 2; begin += part_sizes[part], ++part) {
      const int64_t from = std::max<int64_t>(sent, begin);
      const int64_t to =
          std::min<int64_t>(sent + size, begin + part_sizes[part]);
      if (to > from) chunk->append(parts[part] + (from - begin), to - from);
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
    return absl::CancelledError(absl::StrCat("upload of ", upload.model,
                                             " cancelled after ", sent, " of ",
                                             total, " bytes"));
  }
  if (!status.ok()) return FromGrpcStatus(status);
  if (response.weights_sha256() != digest) {
    return absl::DataLossError(absl::StrCat(
        "upload of ", upload.model, ": the server reports weights ",
        response.weights_sha256(), ", the client sent ", digest));
  }
  return response;
}

// ---------------------------------------------------------------- push

PushReport PushToTargets(const std::vector<std::string>& targets,
                         const LogpClient::Options& connection,
                         const ModelRepositoryClient::Options& options,
                         const LmHeadUpload& upload) {
  PushReport report;
  if (targets.empty()) {
    report.status = absl::InvalidArgumentError("push: no targets");
    return report;
  }
  report.targets.resize(targets.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < targets.size(); ++i) {
    threads.emplace_back([&, i] {
      PushedVersion& out = report.targets[i];
      out.target = targets[i];
      LogpClient::Options target_connection = connection;
      target_connection.target = targets[i];
      target_connection.own_connection = true;
      auto client = ModelRepositoryClient::Create(target_connection, options);
      if (!client.ok()) {
        out.version = client.status();
        return;
      }
      out.version = (*client)->UploadModel(upload);
    });
  }
  for (std::thread& thread : threads) thread.join();

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
  if (!failed.empty()) {
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
