#include "client/cli_score.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cuda_runtime_loader.h"
#include "client/random_rows.h"
#include "client/tensor_files.h"

namespace detlogp::client {
namespace {

// The call's time outside the server. Server times are summed over the
// call's requests, which ran side by side over `connections` connections.
int64_t TransferMicros(int64_t call_us, int64_t server_us, int connections) {
  return std::max<int64_t>(call_us - server_us / std::max(connections, 1), 0);
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() ||
          std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

bool SameBits(const ScoreResult& a, const ScoreResult& b) {
  return SameBits(a.logprobs, b.logprobs) && SameBits(a.lse, b.lse) &&
         SameBits(a.entropy, b.entropy) && SameBits(a.top_ids, b.top_ids) &&
         SameBits(a.top_logprobs, b.top_logprobs);
}

// The rows copied to `device`, for the device path.
absl::StatusOr<std::unique_ptr<DeviceMemory>> UploadRows(
    const CudaRuntime& cuda, int device, const std::string& data) {
  const int64_t bytes = static_cast<int64_t>(data.size());
  auto memory = DeviceMemory::Allocate(&cuda, device, bytes);
  if (!memory.ok()) return memory.status();
  if (absl::Status s = cuda.Copy((*memory)->data(), data.data(), bytes,
                                 CudaCopy::kHostToDevice, device, nullptr);
      !s.ok()) {
    return s;
  }
  return memory;
}

}  // namespace

absl::Status RunScore(LogpClient& client, const ScoreCommandOptions& options) {
  auto info = client.GetModelInfo(options.model, options.model_version);
  if (!info.ok()) return info.status();
  detlogp::v1::DType dtype = detlogp::v1::DTYPE_BFLOAT16;
  int64_t rows = 0;
  std::string data;
  std::vector<int64_t> targets;
  if (options.hidden_path.empty()) {
    rows = options.random_rows;
    data = RandomBf16Rows(rows, info->hidden_size(), options.seed);
    targets = RandomTargets(rows, info->vocab_size(), options.seed + 1);
  } else {
    auto hidden = ReadTensorFile(options.hidden_path, options.hidden_tensor);
    if (!hidden.ok()) return hidden.status();
    if (hidden->shape.size() != 2 || hidden->data.empty()) {
      return absl::InvalidArgumentError(
          "--hidden: expected a float [N, H] tensor");
    }
    dtype = hidden->dtype;
    rows = hidden->shape[0];
    data = std::move(hidden->data);
    if (options.target_ids_path.empty()) {
      return absl::InvalidArgumentError("--targets is required with --hidden");
    }
    auto target_file =
        ReadTensorFile(options.target_ids_path, options.target_ids_tensor);
    if (!target_file.ok()) return target_file.status();
    targets = target_file->integers;
  }
  LogProbOptions request_options;
  request_options.temperature = options.temperature;
  request_options.return_lse = options.return_lse;
  request_options.return_entropy = options.return_entropy;
  request_options.top_k = options.top_k;
  request_options.model = info->model();
  request_options.model_version = info->model_version();
  // The client checks the answer's sizes against the request (N rows, N * k
  // top-k entries); the server checks top_k.
  request_options.return_timing = options.timing;
  if (options.repeats < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--score_repeats=", options.repeats, " must be at least 1"));
  }
  const absl::Time build_start = absl::Now();
  // The call, made options.repeats times on the same client.
  std::function<absl::StatusOr<ScoreResult>()> call;
  std::unique_ptr<CudaRuntime> cuda_runtime;
  std::unique_ptr<DeviceMemory> device_memory;
  DeviceRows on_gpu;
  detlogp::v1::LogProbRequest request;
  if (options.cuda_shared_memory) {
    auto cuda = CudaRuntime::Load(CudaRuntime::Options());
    if (!cuda.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--cuda_shared_memory: ", cuda.status().message()));
    }
    auto device_rows = UploadRows(**cuda, options.cuda_device, data);
    if (!device_rows.ok()) {
      return absl::Status(
          device_rows.status().code(),
          absl::StrCat("--cuda_shared_memory: uploading the rows to cuda:",
                       options.cuda_device, ": ",
                       device_rows.status().message()));
    }
    cuda_runtime = *std::move(cuda);
    device_memory = *std::move(device_rows);
    on_gpu.data = device_memory->data();
    on_gpu.device = options.cuda_device;
    on_gpu.dtype = dtype;
    on_gpu.rows = rows;
    on_gpu.hidden_size = info->hidden_size();
    call = [&] {
      return client.Score(on_gpu, targets, request_options, "cli");
    };
  } else {
    request = MakeLogProbRequest("cli", dtype, rows, info->hidden_size(),
                                 std::move(data), targets, request_options);
    call = [&] { return client.Score(request); };
  }
  absl::Duration build = absl::Now() - build_start;
  // The region the rows were meant to take (CUDA regions hold bf16 only).
  std::string wanted;
  if (options.cuda_shared_memory && dtype == detlogp::v1::DTYPE_BFLOAT16) {
    wanted = "cuda_shm";
  } else if (options.shared_memory) {
    wanted = "system_shm";
  }
  absl::StatusOr<ScoreResult> result;
  for (int repeat = 0; repeat < options.repeats; ++repeat) {
    const absl::Time call_start = absl::Now();
    absl::StatusOr<ScoreResult> answer = call();
    const absl::Time call_end = absl::Now();
    if (!answer.ok()) return answer.status();
    if (repeat == 0 && !wanted.empty() && answer->path != wanted) {
      std::fprintf(stderr, "%s not used (path %s): %s\n", wanted.c_str(),
                   answer->path.c_str(),
                   client.shared_memory_refusal().c_str());
    }
    if (options.timing) {
      const detlogp::v1::ServerTiming& t = answer->server_timing;
      const int64_t call_us = absl::ToInt64Microseconds(call_end - call_start);
      std::fprintf(
          stderr,
          "timing build_us %lld call_us %lld server_us %lld validate_us %lld "
          "queue_us %lld compute_us %lld transfer_us %lld requests %lld "
          "connections %d path %s\n",
          static_cast<long long>(absl::ToInt64Microseconds(build)),
          static_cast<long long>(call_us), static_cast<long long>(t.total_us()),
          static_cast<long long>(t.validate_us()),
          static_cast<long long>(t.queue_us()),
          static_cast<long long>(t.compute_us()),
          static_cast<long long>(
              TransferMicros(call_us, t.total_us(), answer->connections)),
          static_cast<long long>(answer->requests), answer->connections,
          answer->path.c_str());
    }
    build = absl::ZeroDuration();  // built once
    if (repeat == 0) {
      result = *std::move(answer);
    } else if (!SameBits(*result, *answer)) {
      return absl::DataLossError(
          absl::StrCat("call ", repeat + 1,
                       " of --score_repeats answered other bits than "
                       "the first for the same rows"));
    }
  }
  std::printf("model %s version %lld\ndeterminism_key %s\n",
              result->model.c_str(),
              static_cast<long long>(result->model_version),
              result->determinism_key.c_str());
  // One line per row of "name value" pairs; a top-k list is one value,
  // comma-separated.
  const int64_t k = result->top_k;
  for (int64_t r = 0; r < rows; ++r) {
    std::printf("row %lld target %lld logprob %.9g", static_cast<long long>(r),
                static_cast<long long>(targets[r]), result->logprobs[r]);
    if (!result->lse.empty()) std::printf(" lse %.9g", result->lse[r]);
    if (!result->entropy.empty()) {
      std::printf(" entropy %.9g", result->entropy[r]);
    }
    if (k > 0) {
      std::printf(" top_ids ");
      for (int64_t j = 0; j < k; ++j) {
        std::printf("%s%lld", j ? "," : "",
                    static_cast<long long>(result->top_ids[r * k + j]));
      }
      std::printf(" top_logprobs ");
      for (int64_t j = 0; j < k; ++j) {
        std::printf("%s%.9g", j ? "," : "", result->top_logprobs[r * k + j]);
      }
    }
    std::printf("\n");
  }
  return absl::OkStatus();
}

}  // namespace detlogp::client
