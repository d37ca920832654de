// Starts the real server binary (CPU backend, embedded model) on a loopback
// port and talks to it over gRPC.
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <iostream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/invariance_check.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "kernels/bfloat16.h"
#include "kernels/split_policy.h"
#include "proto/status_details.h"
#include "server/models/lm_head_weights.h"
#include "tests/linear_logp_reference.h"
#include "tests/replica_kill_run.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using client::MakeLogProbRequest;
using testing::ServerProcess;
using v1::LogProbRequest;

class ServerIntegrationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // A 160 MiB message limit (the default is larger) for the oversized
    // message test.
    auto server =
        ServerProcess::Start({"--device=cpu", "--max_message_mb=160"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(SIGTERM), 0) << server_->Log();
    delete server_;
  }

  std::unique_ptr<LogpClient> Connect() {
    LogpClient::Options options;
    options.target = server_->target();
    return *LogpClient::Create(options);
  }

  LogProbRequest Bf16Request(int64_t rows, uint64_t seed,
                             int64_t hidden = 1024) {
    return MakeLogProbRequest(
        absl::StrCat("r", seed), v1::DTYPE_BFLOAT16, rows, hidden,
        client::RandomBf16Rows(rows, hidden, seed),
        client::RandomTargets(rows, 32000, seed), 1.0f, true);
  }

  static ServerProcess* server_;
};
ServerProcess* ServerIntegrationTest::server_ = nullptr;

TEST_F(ServerIntegrationTest, ModelInfoDescribesTheEmbeddedModel) {
  auto info = Connect()->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->hidden_size(), 1024);
  EXPECT_EQ(info->vocab_size(), 32000);
  EXPECT_EQ(info->padded_vocab_size(), 32000);
  EXPECT_EQ(info->weight_dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_TRUE(info->has_bias());
  EXPECT_EQ(info->weights_sha256(), server::SyntheticLmHead({}).sha256);
  EXPECT_EQ(info->split_policy(), kernels::kSplitPolicyName);
  EXPECT_EQ(info->determinism_key().rfind("dk1-", 0), 0u);
  EXPECT_NE(info->backend().find("cpu"), std::string::npos);
  EXPECT_NE(server_->Log().find("EMBEDDED SYNTHETIC"), std::string::npos);
}

TEST_F(ServerIntegrationTest, LogprobsMatchFloat64ReferenceForEveryDtype) {
  const server::LmHeadWeights weights = server::SyntheticLmHead({});
  auto client = Connect();
  const int64_t rows = 4;
  const std::string bf16 = client::RandomBf16Rows(rows, 1024, 99);
  const std::vector<int64_t> targets = client::RandomTargets(rows, 32000, 98);
  // The same values as fp32 and fp16 requests: fp32 is exact; fp16 rounds
  // first, so its reference uses its own bf16 conversion.
  std::string fp32(rows * 1024 * 4, '\0');
  for (int64_t i = 0; i < rows * 1024; ++i) {
    uint16_t bits;
    std::memcpy(&bits, &bf16[2 * i], 2);
    const float value = kernels::Bf16ToFloat(bits);
    std::memcpy(&fp32[4 * i], &value, 4);
  }
  for (auto [dtype, data] : {std::pair{v1::DTYPE_BFLOAT16, bf16},
                             std::pair{v1::DTYPE_FLOAT32, fp32}}) {
    auto result = client->Score(MakeLogProbRequest("ref", dtype, rows, 1024,
                                                   data, targets, 0.8f, true));
    ASSERT_TRUE(result.ok()) << result.status();
    for (int64_t r = 0; r < rows; ++r) {
      const auto ref = testing::ReferenceLinearLogp(
          weights.view(),
          reinterpret_cast<const uint16_t*>(bf16.data()) + r * 1024,
          static_cast<int32_t>(targets[r]), 0.8);
      EXPECT_NEAR(result->logprobs[r], ref.logprob, 1e-3);
      EXPECT_NEAR(result->lse[r], ref.lse, 1e-3);
    }
  }
}

TEST_F(ServerIntegrationTest, Fp16RowsAreRoundedToBf16) {
  auto client = Connect();
  // fp16 1.0 = 0x3c00; as bf16 0x3f80.
  std::string fp16(1024 * 2, '\0');
  std::string bf16(1024 * 2, '\0');
  for (int i = 0; i < 1024; ++i) {
    fp16[2 * i + 1] = 0x3c;
    bf16[2 * i] = static_cast<char>(0x80);
    bf16[2 * i + 1] = 0x3f;
  }
  auto a = client->Score(MakeLogProbRequest("h", v1::DTYPE_FLOAT16, 1, 1024,
                                            fp16, {5}, 1.0f, true));
  auto b = client->Score(MakeLogProbRequest("b", v1::DTYPE_BFLOAT16, 1, 1024,
                                            bf16, {5}, 1.0f, true));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(std::memcmp(&a->logprobs[0], &b->logprobs[0], 4), 0);
}

// 12 probe rows scored alone, then inside `concurrency` x 3 mixed unary and
// streamed calls of up to 48 rows: every probe's bits must be unchanged.
void ExpectProbesUnchangedUnderMixedCalls(const std::string& target,
                                          int concurrency) {
  client::InvarianceOptions options;
  options.target = target;
  options.probes = 12;
  options.concurrency = concurrency;
  options.calls_per_thread = 3;
  options.max_rows_per_call = 48;
  auto report = client::CheckInvariance(options);
  ASSERT_TRUE(report.ok()) << report.status();
  std::cout << report->Summary() << "\n";
  EXPECT_TRUE(report->ok()) << report->Summary();
  EXPECT_GE(report->calls, 3 * concurrency);
  EXPECT_GT(report->stream_calls, 0);
}

TEST_F(ServerIntegrationTest, BitsUnchangedUnder32ConcurrentMixedCalls) {
  ExpectProbesUnchangedUnderMixedCalls(server_->target(), 32);
}

TEST_F(ServerIntegrationTest, StreamAnswersInOrderWithIdsEchoed) {
  auto client = Connect();
  std::vector<LogProbRequest> requests;
  for (int i = 0; i < 20; ++i)
    requests.push_back(Bf16Request(1 + (i * 7) % 13, 500 + i));
  auto results = client->ScoreStream(requests);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ((*results)[i].request_id, requests[i].request_id());
    EXPECT_EQ((*results)[i].logprobs.size(),
              static_cast<size_t>(requests[i].hidden().shape(0)));
    // The same request alone gives the same bits.
    auto alone = client->Score(requests[i]);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(std::memcmp(alone->logprobs.data(), (*results)[i].logprobs.data(),
                          alone->logprobs.size() * 4),
              0);
  }
}

TEST_F(ServerIntegrationTest, EveryBadInputIsInvalidArgumentNamingTheField) {
  auto client = Connect();
  struct Case {
    std::string field;
    std::function<void(LogProbRequest*)> corrupt;
  };
  const std::vector<Case> cases = {
      {"hidden.shape",
       [](LogProbRequest* r) { r->mutable_hidden()->add_shape(1); }},
      {"hidden.shape[1]",
       [](LogProbRequest* r) { r->mutable_hidden()->set_shape(1, 512); }},
      {"hidden.data",
       [](LogProbRequest* r) {
         r->mutable_hidden()->mutable_data()->pop_back();
       }},
      {"hidden.dtype",
       [](LogProbRequest* r) {
         r->mutable_hidden()->set_dtype(v1::DTYPE_UNSPECIFIED);
       }},
      {"target_ids", [](LogProbRequest* r) { r->add_target_ids(1); }},
      {"target_ids[1]", [](LogProbRequest* r) { r->set_target_ids(1, 32000); }},
      {"target_ids[0]", [](LogProbRequest* r) { r->set_target_ids(0, -5); }},
      {"temperature", [](LogProbRequest* r) { r->set_temperature(NAN); }},
      {"temperature", [](LogProbRequest* r) { r->set_temperature(INFINITY); }},
      {"temperature", [](LogProbRequest* r) { r->set_temperature(-0.5f); }},
  };
  for (const Case& c : cases) {
    LogProbRequest request = Bf16Request(3, 7);
    c.corrupt(&request);
    auto result = client->Score(request);
    ASSERT_FALSE(result.ok()) << c.field;
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument)
        << c.field;
    EXPECT_NE(result.status().message().find(c.field), std::string::npos)
        << result.status().message();
  }
  // The server is still up and serving good requests.
  EXPECT_TRUE(client->Score(Bf16Request(2, 8)).ok());
}

TEST_F(ServerIntegrationTest, BadRequestInStreamEndsItAfterEarlierAnswers) {
  auto client = Connect();
  std::vector<LogProbRequest> requests = {Bf16Request(2, 1), Bf16Request(2, 2)};
  requests[1].set_temperature(-1.0f);
  requests.push_back(Bf16Request(2, 3));
  grpc::ClientContext context;
  auto stream = client->stub()->StreamLogProbs(&context);
  for (const auto& request : requests) stream->Write(request);
  stream->WritesDone();
  v1::LogProbResponse response;
  int answers = 0;
  while (stream->Read(&response)) ++answers;
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(answers, 1);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("temperature"), std::string::npos);
}

TEST_F(ServerIntegrationTest, OversizedMessageIsRefused) {
  auto client = Connect();
  // 90k rows x 1024 x 2 bytes = 180 MiB > the server's 160 MiB limit.
  LogProbRequest request =
      MakeLogProbRequest("big", v1::DTYPE_BFLOAT16, 90 * 1024, 1024,
                         std::string(180u << 20, '\x01'),
                         std::vector<int64_t>(90 * 1024, 1), 1.0f, false);
  LogpClient::Options options;
  options.target = server_->target();
  options.max_message_bytes = 256 << 20;
  options.split_large_calls = false;  // sent whole, as a plain client would
  auto big_client = *LogpClient::Create(options);
  auto result = big_client->Score(request);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(client->Score(Bf16Request(1, 9)).ok());
}

TEST_F(ServerIntegrationTest, HealthIsServing) {
  auto channel = grpc::CreateChannel(server_->target(),
                                     grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  for (const std::string service : {"", "detlogp.v1.LogProbService"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(stub->Check(&context, request, &response).ok()) << service;
    EXPECT_EQ(response.status(),
              grpc::health::v1::HealthCheckResponse::SERVING);
  }
}

TEST_F(ServerIntegrationTest, ReflectionListsTheServices) {
  auto channel = grpc::CreateChannel(server_->target(),
                                     grpc::InsecureChannelCredentials());
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext context;
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> names;
  for (const auto& service : response.list_services_response().service()) {
    names.push_back(service.name());
  }
  EXPECT_NE(std::find(names.begin(), names.end(), "detlogp.v1.LogProbService"),
            names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "grpc.health.v1.Health"),
            names.end());
  while (stream->Read(&response)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// ---- Servers of their own: slow, small queues, signals. ----

// A request big enough to keep the 2-core CPU backend busy for a while.
LogProbRequest SlowRequest(int64_t rows, uint64_t seed) {
  return MakeLogProbRequest(
      absl::StrCat("slow", seed), v1::DTYPE_BFLOAT16, rows, 1024,
      client::RandomBf16Rows(rows, 1024, seed),
      client::RandomTargets(rows, 32000, seed), 1.0f, false);
}

// The value of the first exposition line starting with `series`.
double MetricValue(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

// --logp_kernel names a CUDA kernel: a server that would serve from the CPU
// instead (no GPU, or --device=cpu) refuses to start.
TEST(ServerLifecycleTest, ForcedKernelNeverFallsBackToTheCpu) {
  for (const char* device : {"--device=cpu", "--device=auto"}) {
    auto forced = ServerProcess::Start({device, "--logp_kernel=portable"}, 60);
    if (forced.ok() && absl::StrContains((*forced)->Log(), "backend cuda")) {
      continue;  // a GPU machine: --device=auto may really run the kernel
    }
    ASSERT_FALSE(forced.ok()) << device;
    EXPECT_TRUE(
        absl::StrContains(forced.status().message(),
                          "--logp_kernel=portable chooses a CUDA kernel"))
        << forced.status();
  }
}

TEST(ServerLifecycleTest, ExpiredAndCancelledCallsAreDroppedBeforeCompute) {
  // A queue bounded by rows only: the calls below must wait in it (a
  // bound in time, a second of this slow work, would refuse them).
  auto server =
      ServerProcess::Start({"--device=cpu", "--max_batch_rows=64",
                            "--max_queue_work_ms=0", "--metrics_port=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options options;
  options.target = (*server)->target();
  auto client = *LogpClient::Create(options);
  // Occupy the batcher: 8 batches of 64 rows, well over half a second.
  std::thread busy(
      [&] { EXPECT_TRUE(client->Score(SlowRequest(512, 1)).ok()); });
  absl::SleepFor(absl::Milliseconds(100));
  int deadline_exceeded = 0;
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext context;
    context.set_deadline(
        absl::ToChronoTime(absl::Now() + absl::Milliseconds(30)));
    v1::LogProbResponse response;
    const grpc::Status status = client->stub()->ComputeLogProbs(
        &context, SlowRequest(8, 10 + i), &response);
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      ++deadline_exceeded;
  }
  EXPECT_EQ(deadline_exceeded, 5);
  // Cancelled while queued.
  grpc::ClientContext cancelled_context;
  v1::LogProbResponse cancelled_response;
  grpc::Status cancelled_status;
  absl::Notification cancelled_done;
  const LogProbRequest cancelled_request = SlowRequest(8, 30);
  client->stub()->async()->ComputeLogProbs(
      &cancelled_context, &cancelled_request, &cancelled_response,
      [&](grpc::Status s) {
        cancelled_status = s;
        cancelled_done.Notify();
      });
  absl::SleepFor(absl::Milliseconds(20));
  cancelled_context.TryCancel();
  cancelled_done.WaitForNotification();
  EXPECT_EQ(cancelled_status.error_code(), grpc::StatusCode::CANCELLED);
  busy.join();
  EXPECT_TRUE(client->Score(SlowRequest(2, 40)).ok());
  auto metrics = (*server)->HttpGet("/metrics");
  ASSERT_TRUE(metrics.ok());
  // A call whose deadline passed is also cancelled by gRPC; whichever the
  // server notices first names it, but none of the 48 rows was computed.
  const double expired = MetricValue(*metrics, "detlogp_rows_expired_total");
  const double cancelled =
      MetricValue(*metrics, "detlogp_rows_cancelled_total");
  EXPECT_EQ(expired + cancelled, 48);
  EXPECT_GE(cancelled, 8);
  EXPECT_GE(expired, 8);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
  const std::string log = (*server)->Log();
  // Warm-up 2 + 512 + 2 rows computed; the 5 x 8 expired rows and the 8
  // cancelled rows never reached the kernel.
  EXPECT_NE(log.find("516 rows computed"), std::string::npos) << log;
}

// The GPU backend's batching mode on the CPU: a batch thread that polls for
// work instead of sleeping, one batch at a time.
TEST(ServerLifecycleTest, BitsUnchangedWithAPollingBatchThread) {
  auto server = ServerProcess::Start(
      {"--device=cpu", "--batch_threads=3", "--batch_spin_us=2000",
       "--batch_overlap_rows=1000000", "--max_queue_delay_us=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  ExpectProbesUnchangedUnderMixedCalls((*server)->target(), 24);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

TEST(ServerLifecycleTest, MetricsCountCallsRowsAndBatches) {
  auto server = ServerProcess::Start({"--device=cpu", "--metrics_port=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->metrics_port(), 0);
  LogpClient::Options options;
  options.target = (*server)->target();
  auto client = *LogpClient::Create(options);
  // First: the client then knows the server's queue and asks no more.
  ASSERT_TRUE(client->GetModelInfo().ok());
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(client->Score(SlowRequest(5, 700 + i)).ok());
  LogProbRequest bad = SlowRequest(2, 710);
  bad.set_temperature(-1);
  EXPECT_FALSE(client->Score(bad).ok());
  auto text = (*server)->HttpGet("/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("HTTP/1.1 200 OK"), std::string::npos);
  EXPECT_EQ(
      MetricValue(
          *text,
          "detlogp_requests_total{method=\"ComputeLogProbs\",code=\"OK\"}"),
      3);
  EXPECT_EQ(MetricValue(*text,
                        "detlogp_requests_total{method=\"ComputeLogProbs\","
                        "code=\"INVALID_ARGUMENT\"}"),
            1);
  EXPECT_EQ(
      MetricValue(
          *text, "detlogp_requests_total{method=\"GetModelInfo\",code=\"OK\"}"),
      1);
  // The warm-up batch counts too: 2 + 3 x 5 rows.
  EXPECT_EQ(MetricValue(*text, "detlogp_rows_total{outcome=\"computed\"}"), 17);
  EXPECT_EQ(MetricValue(*text, "detlogp_rows_total{outcome=\"expired\"}"), 0);
  EXPECT_EQ(MetricValue(*text, "detlogp_batch_rows_count"), 4);
  EXPECT_EQ(MetricValue(*text, "detlogp_queue_rows"), 0);
  EXPECT_GE(MetricValue(*text, "detlogp_compute_seconds_sum"), 0);
  EXPECT_EQ(MetricValue(*text, "detlogp_gather_seconds_count"), 4);
  EXPECT_GT(MetricValue(*text, "detlogp_gather_seconds_sum"), 0);
  EXPECT_EQ(MetricValue(*text, "detlogp_device_memory_used_bytes"), 0);
  auto missing = (*server)->HttpGet("/nope");
  ASSERT_TRUE(missing.ok());
  EXPECT_NE(missing->find("404"), std::string::npos);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

// A CPU server whose queue two 32-row batches fill.
const std::vector<std::string> kSmallQueueFlags = {
    "--device=cpu", "--max_batch_rows=32", "--max_queue_rows=64"};

std::unique_ptr<LogpClient> ClientOf(const ServerProcess& server) {
  LogpClient::Options options;
  options.target = server.target();
  return *LogpClient::Create(options);
}

// The server's side of flow control: a full queue is RESOURCE_EXHAUSTED
// with reason QUEUE_FULL, a RetryInfo and gRPC's pushback trailer, read
// here through the plain generated stub (which retries nothing).
TEST(ServerLifecycleTest, FullQueueSaysWhenToComeBack) {
  auto server = ServerProcess::Start(kSmallQueueFlags);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel((*server)->target(),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::LogProbService::NewStub(channel);
  {
    grpc::ClientContext context;
    v1::GetModelInfoRequest request;
    v1::ModelInfo info;
    ASSERT_TRUE(stub->GetModelInfo(&context, request, &info).ok());
    EXPECT_EQ(info.max_queue_rows(), 64);
  }
  std::atomic<int> ok{0}, queue_full{0}, other{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 12; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext context;
      v1::LogProbResponse response;
      const grpc::Status status =
          stub->ComputeLogProbs(&context, SlowRequest(32, 100 + i), &response);
      if (status.ok()) {
        ++ok;
        return;
      }
      const absl::Status received = client::FromGrpcStatus(status);
      const v1::ErrorDetails details = v1::DetailsOf(received);
      const auto& trailers = context.GetServerTrailingMetadata();
      const auto pushback = trailers.find("grpc-retry-pushback-ms");
      if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
          details.reason == v1::kReasonQueueFull &&
          details.metadata.count("limit") == 1 &&
          details.metadata.at("limit") == "64" &&
          details.retry_delay.has_value() && pushback != trailers.end() &&
          std::string(pushback->second.data(), pushback->second.size()) ==
              absl::StrCat(absl::ToInt64Milliseconds(*details.retry_delay))) {
        ++queue_full;
      } else {
        ++other;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GT(queue_full.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

// The client's side: the same burst through LogpClient is answered whole,
// the refused requests sent again after the server's delay, with the bits
// each request gets alone.
TEST(ServerLifecycleTest, ClientSendsRefusedRequestsAgainUntilAnswered) {
  auto server = ServerProcess::Start(kSmallQueueFlags);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = ClientOf(**server);
  constexpr int kCallers = 12;
  // A client each, as separate workers: each keeps within the queue, and
  // together they overfill it.
  std::vector<std::unique_ptr<LogpClient>> callers;
  for (int i = 0; i < kCallers; ++i) callers.push_back(ClientOf(**server));
  std::vector<absl::StatusOr<client::ScoreResult>> results(
      kCallers, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back(
        [&, i] { results[i] = callers[i]->Score(SlowRequest(32, 100 + i)); });
  }
  for (auto& t : threads) t.join();
  int64_t retries = 0;
  for (int i = 0; i < kCallers; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    retries += results[i]->queue_full_retries;
    // Alone, with no load: the same bits.
    auto alone = client->Score(SlowRequest(32, 100 + i));
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_EQ(alone->queue_full_retries, 0);
    ASSERT_EQ(alone->logprobs.size(), results[i]->logprobs.size());
    EXPECT_EQ(std::memcmp(alone->logprobs.data(), results[i]->logprobs.data(),
                          alone->logprobs.size() * sizeof(float)),
              0);
  }
  EXPECT_GT(retries, 0);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

// A call whose deadline comes before the queue has room fails with
// DEADLINE_EXCEEDED saying how much was answered, not RESOURCE_EXHAUSTED.
TEST(ServerLifecycleTest, FullQueueUntilTheDeadlineIsDeadlineExceeded) {
  auto server = ServerProcess::Start(kSmallQueueFlags);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = ClientOf(**server);
  std::vector<std::thread> load;
  for (int i = 0; i < 6; ++i) {
    load.emplace_back(
        [&, i] { (void)client->Score(SlowRequest(32, 300 + i)); });
  }
  absl::SleepFor(absl::Milliseconds(30));
  int deadline_exceeded = 0, other_failure = 0;
  for (int i = 0; i < 8; ++i) {
    auto result = client->Score(SlowRequest(32, 400 + i),
                                absl::Now() + absl::Milliseconds(2));
    if (result.ok()) continue;
    if (result.status().code() == absl::StatusCode::kDeadlineExceeded) {
      ++deadline_exceeded;
    } else {
      ADD_FAILURE() << result.status();
      ++other_failure;
    }
  }
  for (auto& t : load) t.join();
  EXPECT_EQ(other_failure, 0);
  EXPECT_GT(deadline_exceeded, 0);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

// Three replicas, eight threads scoring continuously through one client
// given all three, and one replica killed (SIGKILL) mid-run: every call is
// answered, with the bits the same rows get from one server alone.
TEST(ServerLifecycleTest, CallsSurviveAReplicaKilledMidRun) {
  std::vector<std::unique_ptr<ServerProcess>> replicas;
  LogpClient::Options options;
  for (int r = 0; r < 3; ++r) {
    auto server = ServerProcess::Start({"--device=cpu"});
    ASSERT_TRUE(server.ok()) << server.status();
    options.targets.push_back((*server)->target());
    replicas.push_back(*std::move(server));
  }
  constexpr int kThreads = 8;
  std::vector<LogProbRequest> requests;
  std::vector<client::ScoreResult> alone;
  {
    auto single = ClientOf(*replicas[1]);
    for (int t = 0; t < kThreads; ++t) {
      requests.push_back(SlowRequest(24, 900 + t));
      auto answer = single->Score(requests.back());
      ASSERT_TRUE(answer.ok()) << answer.status();
      alone.push_back(*std::move(answer));
    }
  }
  // Each call is cut into requests of 6 rows, spread over the replicas.
  options.max_request_rows = 6;
  auto client = *LogpClient::Create(options);
  const testing::KillRun run;  // 8 answers, then the kill, then 16 calls
  const testing::KillRunCounts counts =
      testing::ScoreWhileKilling(*client, requests, alone, *replicas[0], run);
  EXPECT_EQ(counts.failed, 0);
  EXPECT_EQ(counts.wrong_bits, 0);
  EXPECT_GE(counts.calls_after_kill, run.calls_after_kill);
  // Requests at the killed replica, or probing it after, went elsewhere.
  EXPECT_GT(counts.replica_retries, 0);
  for (int r = 1; r < 3; ++r) EXPECT_EQ(replicas[r]->Stop(SIGTERM), 0);
}

TEST(ServerLifecycleTest, SigtermAnswersEveryAcceptedCallAndExitsZero) {
  auto server = ServerProcess::Start({"--device=cpu", "--max_batch_rows=32"});
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options options;
  options.target = (*server)->target();
  auto client = *LogpClient::Create(options);
  std::atomic<int> ok{0}, failed{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      (client->Score(SlowRequest(32, 300 + i)).ok() ? ok : failed)++;
    });
  }
  absl::SleepFor(absl::Milliseconds(200));  // all accepted, most still queued
  const int exit_code = (*server)->Stop(SIGTERM);
  for (auto& t : threads) t.join();
  EXPECT_EQ(exit_code, 0);
  EXPECT_EQ(ok.load(), 8);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_NE((*server)->Log().find("draining"), std::string::npos);
}

}  // namespace
}  // namespace detlogp
