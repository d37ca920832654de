// End-to-end serving benchmark: C callers, each with one call in flight,
// spread over K connections, send N-row bf16 requests for a fixed time and
// report rows/s, GB/s of hidden states and latency percentiles (JSON + table).
//
//   bazel run //tools/bench:serve_throughput -- --target=127.0.0.1:50051
//       --callers=64 --channels=8 --rows=256 --seconds=10
//
// --shared_memory sends references to a system region instead of the rows.
#include <grpcpp/client_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "client/system_shared_memory.h"
#include "tools/bench/closed_loop_caller.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address.");
ABSL_FLAG(int, callers, 64, "Concurrent callers, one call in flight each.");
ABSL_FLAG(int, channels, 8, "Distinct connections.");
ABSL_FLAG(int, rows, 256, "Rows per request.");
ABSL_FLAG(double, seconds, 10, "Measured duration.");
ABSL_FLAG(double, warmup_seconds, 2, "Unmeasured warm-up.");
ABSL_FLAG(int, payloads, 8, "Distinct request payloads, reused round-robin.");
ABSL_FLAG(bool, shared_memory, false,
          "Requests name their rows in a system shared-memory region "
          "(registered once, the payloads written into it before the run) "
          "instead of carrying them: the server's side of the same-host "
          "path. The server must allow it (--allow_shared_memory).");
ABSL_FLAG(bool, serialized, false,
          "Requests are serialized once before the run and sent as those "
          "bytes: the client spends nothing per call on encoding, so the "
          "figures are the server's and the connection's (a large message "
          "over one connection, say).");
ABSL_FLAG(
    std::vector<std::string>, models, {},
    "Models to score, alternating call by call (empty: the default model).");

namespace {

using detlogp::client::LogpClient;
using detlogp::v1::LogProbRequest;
using detlogp::v1::LogProbResponse;

struct Shared {
  std::vector<std::unique_ptr<LogpClient>> clients;
  std::vector<LogProbRequest> payloads;
  // The payloads' bytes, with --serialized.
  std::vector<grpc::ByteBuffer> serialized;
  absl::Time measure_from;
  absl::Time stop_at;
  // Per payload: the key its model answers with.
  std::vector<std::string> expected_keys;
  absl::Mutex mu;
  std::vector<double> latencies_ms ABSL_GUARDED_BY(mu);
  std::atomic<int64_t> rows_done{0};
  std::atomic<int64_t> calls_done{0};
  std::atomic<int64_t> errors{0};
  std::atomic<int64_t> bad_answers{0};
  std::atomic<int> callers_left{0};
  absl::Notification all_done;
};

// Counts an answer of a call started after the warm-up and answered in time.
void Record(Shared* shared,
            const detlogp::bench::ClosedLoopCaller::Answer& answer) {
  if (answer.started < shared->measure_from ||
      answer.finished > shared->stop_at)
    return;
  const LogProbRequest& request = shared->payloads[answer.payload];
  if (!answer.status.ok()) {
    ++shared->errors;
  } else if (answer.response.logprobs_size() != request.target_ids_size() ||
             answer.response.determinism_key() !=
                 shared->expected_keys[answer.payload]) {
    ++shared->bad_answers;
  } else {
    shared->rows_done += answer.response.logprobs_size();
    ++shared->calls_done;
    absl::MutexLock lock(&shared->mu);
    shared->latencies_ms.push_back(
        absl::ToDoubleMilliseconds(answer.finished - answer.started));
  }
}

double Percentile(std::vector<double>& values, double p) {
  if (values.empty()) return 0;
  const size_t k = std::min(values.size() - 1,
                            static_cast<size_t>(p / 100.0 * values.size()));
  std::nth_element(values.begin(), values.begin() + k, values.end());
  return values[k];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  Shared shared;
  for (int c = 0; c < absl::GetFlag(FLAGS_channels); ++c) {
    LogpClient::Options options;
    options.target = absl::GetFlag(FLAGS_target);
    options.own_connection = true;
    shared.clients.push_back(*LogpClient::Create(options));
  }
  std::vector<std::string> models = absl::GetFlag(FLAGS_models);
  if (models.empty()) models.push_back("");
  const int rows = absl::GetFlag(FLAGS_rows);
  absl::StatusOr<detlogp::v1::ModelInfo> info;
  // Payload p scores model p % models: consecutive calls of a caller
  // alternate between the models.
  for (int p = 0;
       p < absl::GetFlag(FLAGS_payloads) * static_cast<int>(models.size());
       ++p) {
    const std::string& model = models[p % models.size()];
    {
      grpc::ClientContext context;
      detlogp::v1::GetModelInfoRequest info_request;
      info_request.set_model(model);
      detlogp::v1::ModelInfo reply;
      const grpc::Status status = shared.clients[0]->stub()->GetModelInfo(
          &context, info_request, &reply);
      if (!status.ok()) {
        std::fprintf(stderr, "GetModelInfo(%s): %s\n", model.c_str(),
                     status.error_message().c_str());
        return 1;
      }
      info = reply;
    }
    LogProbRequest request = detlogp::client::MakeLogProbRequest(
        absl::StrCat("bench-", p), detlogp::v1::DTYPE_BFLOAT16, rows,
        info->hidden_size(),
        detlogp::client::RandomBf16Rows(rows, info->hidden_size(), 1000 + p),
        detlogp::client::RandomTargets(rows, info->vocab_size(), 2000 + p),
        1.0f, false);
    request.set_model(model);
    shared.payloads.push_back(std::move(request));
    shared.expected_keys.push_back(info->determinism_key());
  }
  // Kept for the whole run: the server maps the region from it.
  std::unique_ptr<detlogp::client::SystemSharedMemory> region;
  if (absl::GetFlag(FLAGS_shared_memory)) {
    int64_t total = 0;
    for (const LogProbRequest& request : shared.payloads) {
      total += static_cast<int64_t>(request.hidden().data().size());
    }
    auto created = detlogp::client::SystemSharedMemory::Create(total);
    if (!created.ok()) {
      std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
      return 1;
    }
    region = *std::move(created);
    detlogp::v1::SystemSharedMemoryRegisterRequest registration;
    registration.set_name(absl::StrCat("serve_throughput_", getpid()));
    registration.set_key(region->key());
    registration.set_byte_size(total);
    grpc::ClientContext context;
    detlogp::v1::SystemSharedMemoryRegisterResponse registered;
    const grpc::Status status =
        detlogp::v1::SharedMemoryService::NewStub(shared.clients[0]->channel())
            ->SystemSharedMemoryRegister(&context, registration, &registered);
    if (!status.ok()) {
      std::fprintf(stderr, "SystemSharedMemoryRegister: %s\n",
                   status.error_message().c_str());
      return 1;
    }
    region->Unlink();
    int64_t offset = 0;
    for (LogProbRequest& request : shared.payloads) {
      const std::string& data = request.hidden().data();
      std::memcpy(region->data() + offset, data.data(), data.size());
      detlogp::v1::SharedMemoryRef* ref =
          request.mutable_hidden()->mutable_shared_memory();
      ref->set_region(registration.name());
      ref->set_offset(offset);
      ref->set_byte_size(static_cast<int64_t>(data.size()));
      offset += static_cast<int64_t>(data.size());
      request.mutable_hidden()->clear_data();
    }
  }
  if (absl::GetFlag(FLAGS_serialized)) {
    for (const LogProbRequest& request : shared.payloads) {
      grpc::Slice bytes(request.SerializeAsString());
      shared.serialized.emplace_back(&bytes, 1);
    }
  }
  const int callers = absl::GetFlag(FLAGS_callers);
  shared.callers_left = callers;
  shared.measure_from =
      absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_warmup_seconds));
  shared.stop_at =
      shared.measure_from + absl::Seconds(absl::GetFlag(FLAGS_seconds));
  std::vector<std::unique_ptr<detlogp::bench::ClosedLoopCaller>> all;
  for (int c = 0; c < callers; ++c) {
    all.push_back(std::make_unique<detlogp::bench::ClosedLoopCaller>(
        shared.clients[c % shared.clients.size()].get(), &shared.payloads, c,
        shared.stop_at,
        [&shared](const auto& answer) { Record(&shared, answer); },
        [&shared] {
          if (--shared.callers_left == 0) shared.all_done.Notify();
        }));
    if (!shared.serialized.empty()) {
      all.back()->SendSerialized(&shared.serialized);
    }
  }
  for (auto& caller : all) caller->Start();
  shared.all_done.WaitForNotification();

  const double seconds = absl::GetFlag(FLAGS_seconds);
  absl::MutexLock lock(&shared.mu);
  std::vector<double>& lat = shared.latencies_ms;
  const double rows_per_s = shared.rows_done / seconds;
  const double gbytes_per_s = rows_per_s * info->hidden_size() * 2 / 1e9;
  const double p50 = Percentile(lat, 50), p90 = Percentile(lat, 90),
               p99 = Percentile(lat, 99),
               max =
                   lat.empty() ? 0 : *std::max_element(lat.begin(), lat.end());
  std::printf(
      "{\"rows_per_request\": %d, \"callers\": %d, \"channels\": %d, "
      "\"seconds\": %.1f, \"calls\": %lld, \"rows_per_s\": %.0f, "
      "\"hidden_gb_per_s\": %.3f, \"p50_ms\": %.3f, \"p90_ms\": %.3f, "
      "\"p99_ms\": %.3f, \"max_ms\": %.3f, \"errors\": %lld, \"bad_answers\": "
      "%lld}\n",
      rows, callers, absl::GetFlag(FLAGS_channels), seconds,
      static_cast<long long>(shared.calls_done.load()), rows_per_s,
      gbytes_per_s, p50, p90, p99, max,
      static_cast<long long>(shared.errors.load()),
      static_cast<long long>(shared.bad_answers.load()));
  std::printf("%-8s %-8s %-12s %-10s %-9s %-9s %-9s %-9s\n", "rows/req",
              "callers", "rows/s", "GB/s", "p50 ms", "p90 ms", "p99 ms",
              "max ms");
  std::printf("%-8d %-8d %-12.0f %-10.3f %-9.3f %-9.3f %-9.3f %-9.3f\n", rows,
              callers, rows_per_s, gbytes_per_s, p50, p90, p99, max);
  return shared.errors.load() == 0 && shared.bad_answers.load() == 0 ? 0 : 1;
}
