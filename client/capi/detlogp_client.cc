#include "client/capi/detlogp_client.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/grpc_lifetime.h"
#include "client/logp_client.h"
#include "client/task_pool.h"
#include "detlogp/v1/detlogp.pb.h"
#include "proto/dtype_bytes.h"
#include "proto/status_details.h"

struct DetlogpClient {
  std::unique_ptr<detlogp::client::LogpClient> client;
  // Runs detlogp_client_score_async's calls; destroyed first, so that every
  // call taken ends (and calls back) while the client is still there.
  std::unique_ptr<detlogp::client::TaskPool> callers;
};

namespace {

using detlogp::client::LogpClient;

constexpr int kDefaultAsyncThreads = 8;
// The integer channel arguments a client may set (gRPC's names): message
// sizes, keepalive, reconnect backoff.
constexpr const char* kIntChannelArgs[] = {
    "grpc.max_receive_message_length",
    "grpc.max_send_message_length",
    "grpc.keepalive_time_ms",
    "grpc.keepalive_timeout_ms",
    "grpc.keepalive_permit_without_calls",
    "grpc.http2.max_pings_without_data",
    "grpc.initial_reconnect_backoff_ms",
    "grpc.min_reconnect_backoff_ms",
    "grpc.max_reconnect_backoff_ms",
};
constexpr char kLbPolicyArg[] = "grpc.lb_policy_name";

int Fail(const absl::Status& status, char* error, size_t error_len) {
  if (error != nullptr && error_len > 0) {
    const std::string message(status.message());
    const size_t n = std::min(message.size(), error_len - 1);
    std::memcpy(error, message.data(), n);
    error[n] = '\0';
  }
  return static_cast<int>(status.code());
}

std::string Text(const char* s) { return s == nullptr ? "" : s; }

void CopyText(const std::string& from, char* to, size_t capacity) {
  const size_t n = std::min(from.size(), capacity - 1);
  std::memcpy(to, from.data(), n);
  to[n] = '\0';
}

absl::Status CheckRequest(const DetlogpScoreRequest& request) {
  if (detlogp::v1::DTypeBytes(request.dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype: ", request.dtype, " is not BFLOAT16, FLOAT16 or FLOAT32"));
  }
  if (request.rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows: ", request.rows, " is negative"));
  }
  if (request.hidden_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_size: ", request.hidden_size, " is not positive"));
  }
  if (request.rows > 0 &&
      (request.hidden == nullptr || request.target_ids == nullptr)) {
    return absl::InvalidArgumentError(
        request.hidden == nullptr ? "hidden: null" : "target_ids: null");
  }
  return absl::OkStatus();
}

// Copies `from` (one value per row, or per row and rank) into `to` when
// the caller gave an array for it.
template <typename T>
absl::Status CopyOut(const std::vector<T>& from, int64_t expected, T* to,
                     const char* field) {
  if (to == nullptr) return absl::OkStatus();
  if (static_cast<int64_t>(from.size()) != expected) {
    return absl::DataLossError(
        absl::StrCat(field, ": ", from.size(), " values, expected ", expected));
  }
  std::copy(from.begin(), from.end(), to);
  return absl::OkStatus();
}

// The details of a failed call's status, without its message (the error
// text has it): none for a status that carries none (a failure of the
// client's own, such as a CUDA runtime that does not load).
void WriteErrorDetails(const absl::Status& status, DetlogpScoreAnswer& answer) {
  if (detlogp::v1::DetailsOf(status).domain.empty()) return;
  absl::Status bare(status.code(), "");
  status.ForEachPayload(
      [&](absl::string_view type_url, const absl::Cord& value) {
        bare.SetPayload(type_url, value);
      });
  const std::string details = detlogp::v1::SerializeStatusDetails(bare);
  if (details.size() > sizeof(answer.error_details)) return;
  std::memcpy(answer.error_details, details.data(), details.size());
  answer.error_details_len = static_cast<int64_t>(details.size());
}

// The options' targets and channel arguments into `settings`; an
// argument this client does not take is refused by its key.
absl::Status ApplyTargetsAndChannelArgs(const DetlogpClientOptions& options,
                                        LogpClient::Options& settings) {
  if (options.target_count < 1 || options.targets == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "targets: ", options.target_count, " given; at least one is needed"));
  }
  for (int i = 0; i < options.target_count; ++i) {
    if (Text(options.targets[i]).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("targets[", i, "]: empty"));
    }
  }
  settings.target = options.targets[0];
  if (options.target_count > 1) {
    settings.targets.assign(options.targets,
                            options.targets + options.target_count);
  }
  if (options.channel_arg_count > 0 && options.channel_args == nullptr) {
    return absl::InvalidArgumentError("channel_args: null");
  }
  for (int i = 0; i < options.channel_arg_count; ++i) {
    const DetlogpChannelArg& arg = options.channel_args[i];
    const std::string key = Text(arg.key);
    if (key == kLbPolicyArg) {
      settings.load_balancing_policy = Text(arg.string_value);
      continue;
    }
    const bool known =
        std::find_if(std::begin(kIntChannelArgs), std::end(kIntChannelArgs),
                     [&](const char* name) { return key == name; }) !=
        std::end(kIntChannelArgs);
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "channel_args: \"", key,
          "\" is not taken by the C++ engine (it takes message sizes, "
          "keepalive, reconnect backoff and grpc.lb_policy_name)"));
    }
    if (arg.int_value < INT_MIN || arg.int_value > INT_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("channel_args: \"", key,
                                                     "\" = ", arg.int_value,
                                                     " is out of int range"));
    }
    settings.int_channel_args.emplace_back(key,
                                           static_cast<int>(arg.int_value));
  }
  return absl::OkStatus();
}

int Score(DetlogpClient* client, const DetlogpScoreRequest* request,
          DetlogpScoreAnswer* answer, char* error, size_t error_len) {
  if (client == nullptr || request == nullptr || answer == nullptr) {
    return Fail(
        absl::InvalidArgumentError(client == nullptr    ? "client: null"
                                   : request == nullptr ? "request: null"
                                                        : "answer: null"),
        error, error_len);
  }
  if (absl::Status valid = CheckRequest(*request); !valid.ok()) {
    return Fail(valid, error, error_len);
  }
  const int64_t rows = request->rows;
  const size_t bytes = static_cast<size_t>(
      rows * request->hidden_size * detlogp::v1::DTypeBytes(request->dtype));
  detlogp::client::LogProbOptions extras;
  extras.temperature = request->temperature;
  extras.return_lse = request->return_lse != 0;
  extras.return_entropy = request->return_entropy != 0;
  extras.top_k = request->top_k;
  extras.model = Text(request->model);
  extras.model_version = request->model_version;
  std::vector<int64_t> targets(request->target_ids, request->target_ids + rows);
  extras.return_timing = request->return_timing != 0;
  const absl::Time deadline =
      request->timeout_s > 0 ? absl::Now() + absl::Seconds(request->timeout_s)
                             : absl::InfiniteFuture();
  absl::StatusOr<detlogp::client::ScoreResult> result;
  if (request->device >= 0) {
    detlogp::client::DeviceRows on_device;
    on_device.data = request->hidden;
    on_device.device = request->device;
    on_device.dtype = static_cast<detlogp::v1::DType>(request->dtype);
    on_device.rows = rows;
    on_device.hidden_size = request->hidden_size;
    on_device.stream = request->stream;
    result = client->client->Score(on_device, targets, extras,
                                   Text(request->request_id), deadline);
  } else {
    // The rows stay where they are: each request's gRPC buffer is written
    // from them.
    const detlogp::v1::LogProbRequest header =
        detlogp::client::MakeLogProbRequest(
            Text(request->request_id),
            static_cast<detlogp::v1::DType>(request->dtype), rows,
            request->hidden_size, /*data=*/"", targets, extras);
    result = client->client->Score(
        header,
        absl::string_view(static_cast<const char*>(request->hidden), bytes),
        deadline);
  }
  answer->error_details_len = 0;
  if (!result.ok()) {
    WriteErrorDetails(result.status(), *answer);
    return Fail(result.status(), error, error_len);
  }

  const int64_t ranked = rows * std::max<int64_t>(request->top_k, 0);
  absl::Status copied =
      CopyOut(result->logprobs, rows, answer->logprobs, "logprobs");
  if (copied.ok() && request->return_lse) {
    copied = CopyOut(result->lse, rows, answer->lse, "lse");
  }
  if (copied.ok() && request->return_entropy) {
    copied = CopyOut(result->entropy, rows, answer->entropy, "entropy");
  }
  if (copied.ok() && request->top_k > 0) {
    copied = CopyOut(result->top_ids, ranked, answer->top_ids, "top_ids");
  }
  if (copied.ok() && request->top_k > 0) {
    copied = CopyOut(result->top_logprobs, ranked, answer->top_logprobs,
                     "top_logprobs");
  }
  if (!copied.ok()) return Fail(copied, error, error_len);
  answer->model_version = result->model_version;
  answer->requests = result->requests;
  answer->connections = result->connections;
  const detlogp::v1::ServerTiming& timing = result->server_timing;
  answer->server_reported_timing = request->return_timing != 0;
  answer->validate_us = timing.validate_us();
  answer->queue_us = timing.queue_us();
  answer->compute_us = timing.compute_us();
  answer->total_us = timing.total_us();
  CopyText(result->model, answer->model, sizeof(answer->model));
  CopyText(result->determinism_key, answer->determinism_key,
           sizeof(answer->determinism_key));
  CopyText(result->path, answer->path, sizeof(answer->path));
  CopyText(result->path_refused, answer->path_refused,
           sizeof(answer->path_refused));
  answer->queue_full_retries = result->queue_full_retries;
  return 0;
}

}  // namespace

extern "C" {

int detlogp_client_abi_version(void) { return DETLOGP_CLIENT_ABI_VERSION; }

int detlogp_client_create(const DetlogpClientOptions* options,
                          DetlogpClient** client, char* error,
                          size_t error_len) {
  if (options == nullptr || client == nullptr) {
    return Fail(absl::InvalidArgumentError(options == nullptr ? "options: null"
                                                              : "client: null"),
                error, error_len);
  }
  LogpClient::Options settings;
  if (absl::Status applied = ApplyTargetsAndChannelArgs(*options, settings);
      !applied.ok()) {
    return Fail(applied, error, error_len);
  }
  if (options->timeout_s > 0) {
    settings.timeout = absl::Seconds(options->timeout_s);
  }
  if (options->max_message_bytes > 0) {
    settings.max_message_bytes = static_cast<int>(
        std::min<int64_t>(options->max_message_bytes, INT32_MAX));
  }
  settings.connections = options->connections;
  settings.system_shared_memory = options->system_shared_memory != 0;
  settings.cuda_shared_memory = options->cuda_shared_memory != 0;
  if (options->spread_request_bytes > 0) {
    settings.spread_request_bytes = options->spread_request_bytes;
  }
  if (options->spread_requests_in_flight > 0) {
    settings.spread_requests_in_flight = options->spread_requests_in_flight;
  }
  if (options->region_piece_bytes > 0) {
    settings.region_piece_bytes = options->region_piece_bytes;
  }
  settings.bearer_token = Text(options->bearer_token);
  settings.tls_root_certs = Text(options->tls_root_certs);
  settings.tls_client_cert = Text(options->tls_client_cert);
  settings.tls_client_key = Text(options->tls_client_key);
  auto created = LogpClient::Create(settings);
  if (!created.ok()) return Fail(created.status(), error, error_len);
  const int threads = options->async_threads > 0 ? options->async_threads
                                                 : kDefaultAsyncThreads;
  *client =
      new DetlogpClient{*std::move(created),
                        std::make_unique<detlogp::client::TaskPool>(threads)};
  return 0;
}

// No C++ exception crosses the C boundary: one (a thread that cannot start,
// memory that cannot be had) fails the call instead.
int detlogp_client_score(DetlogpClient* client,
                         const DetlogpScoreRequest* request,
                         DetlogpScoreAnswer* answer, char* error,
                         size_t error_len) {
  try {
    return Score(client, request, answer, error, error_len);
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(absl::StrCat("C++ client: ", e.what())),
                error, error_len);
  }
}

int detlogp_client_score_async(DetlogpClient* client,
                               const DetlogpScoreRequest* request,
                               DetlogpScoreAnswer* answer,
                               DetlogpScoreDone done, void* user_data,
                               char* error, size_t error_len) {
  if (client == nullptr || done == nullptr) {
    return Fail(absl::InvalidArgumentError(client == nullptr ? "client: null"
                                                             : "done: null"),
                error, error_len);
  }
  // The pool's threads are gone in a forked child: the call would never run.
  if (absl::Status usable = detlogp::client::CheckGrpcUsableInThisProcess();
      !usable.ok()) {
    return Fail(usable, error, error_len);
  }
  try {
    client->callers->Schedule([client, request, answer, done, user_data] {
      char message[4096] = {0};
      const int code = detlogp_client_score(client, request, answer, message,
                                            sizeof(message));
      done(user_data, code, message);
    });
  } catch (const std::exception& e) {
    return Fail(
        absl::ResourceExhaustedError(absl::StrCat("C++ client: ", e.what())),
        error, error_len);
  }
  return 0;
}

void detlogp_client_shared_memory_refusal(DetlogpClient* client, char* text,
                                          size_t text_len) {
  if (client == nullptr || text == nullptr || text_len == 0) return;
  try {
    CopyText(client->client->shared_memory_refusal(), text, text_len);
  } catch (const std::exception&) {
    text[0] = '\0';
  }
}

void detlogp_client_destroy(DetlogpClient* client) {
  // In a forked child the client's threads and connections are the
  // parent's: joining or closing them would wait forever, so it is left to
  // the process's exit.
  if (!detlogp::client::CheckGrpcUsableInThisProcess().ok()) return;
  delete client;
}

}  // extern "C"
