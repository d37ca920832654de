// LogpClient's region calls and data paths against the real server binary
// (CPU backend, a small synthetic model) on loopback: regions the caller
// manages (system: the bits of message bytes; CUDA: the CPU server's
// refusal), references the server refuses naming the field, rows on a GPU
// without a CUDA runtime, the client's own system region registered again
// after the server released it, and spread connections kept between calls.
// Needs no GPU and no CUDA runtime.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "client/system_shared_memory.h"
#include "tests/score_result_bits.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using client::ScoreResult;
using client::SystemSharedMemory;
using testing::ExpectSameBits;
using testing::SameBits;
using testing::ServerProcess;
using v1::LogProbRequest;

constexpr int64_t kHidden = 256;
constexpr int64_t kVocab = 4096;

std::vector<std::string> ServerArgs(std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "--device=cpu", absl::StrCat("--synthetic_hidden_size=", kHidden),
      absl::StrCat("--synthetic_vocab_size=", kVocab), "--metrics_port=0"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

client::LogProbOptions Extras() {
  client::LogProbOptions options;
  options.return_lse = true;
  options.return_entropy = true;
  options.top_k = 5;
  return options;
}

LogProbRequest Request(int64_t rows, uint64_t seed) {
  return client::MakeLogProbRequest(
      absl::StrCat("r", seed), v1::DTYPE_BFLOAT16, rows, kHidden,
      client::RandomBf16Rows(rows, kHidden, seed),
      client::RandomTargets(rows, kVocab, seed), Extras());
}

std::unique_ptr<LogpClient> Connect(const ServerProcess& server,
                                    LogpClient::Options options = {}) {
  options.target = server.target();
  auto client = LogpClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return *std::move(client);
}

class LogpClientRegionsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start(ServerArgs());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(SIGTERM), 0);
    }
    delete server_;
    server_ = nullptr;
  }
  static ServerProcess* server_;
};
ServerProcess* LogpClientRegionsTest::server_ = nullptr;

TEST_F(LogpClientRegionsTest, ACallersSystemRegionGivesTheBitsOfBytes) {
  auto client = Connect(*server_);
  const LogProbRequest request = Request(1234, 7);
  const std::string& rows = request.hidden().data();
  const int64_t offset = 4099;  // rows need no alignment
  auto shm = SystemSharedMemory::Create(offset + rows.size() + 100);
  ASSERT_TRUE(shm.ok()) << shm.status();
  std::memcpy((*shm)->data() + offset, rows.data(), rows.size());
  ASSERT_TRUE(
      client->RegisterSystemRegion("callers", (*shm)->key(), 0, (*shm)->bytes())
          .ok());
  const std::vector<int64_t> targets(request.target_ids().begin(),
                                     request.target_ids().end());
  client::RegionRef ref;
  ref.region = "callers";
  ref.offset = offset;  // byte_size 0: the rows' size
  const LogProbRequest by_reference = client::MakeLogProbRequest(
      "ref", v1::DTYPE_BFLOAT16, 1234, kHidden, ref, targets, Extras());
  EXPECT_TRUE(by_reference.hidden().data().empty());
  EXPECT_EQ(by_reference.hidden().shared_memory().byte_size(),
            static_cast<int64_t>(rows.size()));

  auto over_grpc = client->Score(request);
  ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
  EXPECT_EQ(over_grpc->path, "grpc");
  EXPECT_FALSE(over_grpc->used_shared_memory);
  auto over_region = client->Score(by_reference);
  ASSERT_TRUE(over_region.ok()) << over_region.status();
  EXPECT_EQ(over_region->path, "named_region");
  EXPECT_TRUE(over_region->used_shared_memory);
  EXPECT_EQ(over_region->connections, 1);
  ExpectSameBits(*over_grpc, *over_region);

  // Cut into 100-row requests, each naming its rows in the region.
  LogpClient::Options cut;
  cut.max_request_rows = 100;
  auto sliced = Connect(*server_, cut)->Score(by_reference);
  ASSERT_TRUE(sliced.ok()) << sliced.status();
  EXPECT_EQ(sliced->requests, 13);
  EXPECT_EQ(sliced->connections, 1);
  ExpectSameBits(*over_grpc, *sliced);

  auto status = client->SystemRegionStatus("callers");
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->regions_size(), 1);
  EXPECT_EQ(status->regions(0).key(), (*shm)->key());
  EXPECT_EQ(status->regions(0).use().requests(), 14);
  ASSERT_TRUE(client->UnregisterSystemRegion("callers").ok());
  status = client->SystemRegionStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->regions_size(), 0);
  auto gone = client->Score(by_reference);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(
      absl::StartsWith(gone.status().message(), "hidden.shared_memory.region"))
      << gone.status();
}

TEST_F(LogpClientRegionsTest, BadReferencesAreRefusedNamingTheField) {
  auto client = Connect(*server_);
  auto shm = SystemSharedMemory::Create(1 << 20);
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(
      client->RegisterSystemRegion("bad_refs", (*shm)->key(), 0, 1 << 20).ok());
  const std::vector<int64_t> targets = {1, 2, 3};
  struct Case {
    client::RegionRef ref;
    absl::StatusCode code;
    std::string field;
  };
  const int64_t bytes = 3 * kHidden * 2;
  const std::vector<Case> cases = {
      {{"no_such_region", 0, 0},
       absl::StatusCode::kNotFound,
       "hidden.shared_memory.region"},
      {{"bad_refs", (1 << 20) + 1, 0},
       absl::StatusCode::kInvalidArgument,
       "hidden.shared_memory.offset"},
      {{"bad_refs", (1 << 20) - 10, 0},
       absl::StatusCode::kInvalidArgument,
       "hidden.shared_memory.byte_size"},
      {{"bad_refs", -1, 0},
       absl::StatusCode::kInvalidArgument,
       "hidden.shared_memory.offset"},
      {{"bad_refs", 0, bytes + 2},
       absl::StatusCode::kInvalidArgument,
       "hidden.shared_memory.byte_size"},
  };
  for (const Case& c : cases) {
    auto refused = client->Score(client::MakeLogProbRequest(
        "bad", v1::DTYPE_BFLOAT16, 3, kHidden, c.ref, targets, {}));
    EXPECT_EQ(refused.status().code(), c.code) << refused.status();
    EXPECT_TRUE(absl::StartsWith(refused.status().message(), c.field))
        << c.field << ": " << refused.status();
  }
  // Registration: the server names each field.
  struct Registration {
    std::string name, key;
    int64_t offset, byte_size;
    std::string field;
  };
  for (const Registration& r : std::vector<Registration>{
           {"bad name!", (*shm)->key(), 0, 1024, "name:"},
           {"k", "/detlogp_no_such_object", 0, 1024, "key:"},
           {"o", (*shm)->key(), -1, 1024, "offset:"},
           {"s", (*shm)->key(), 0, 0, "byte_size:"},
           {"bad_refs", (*shm)->key(), 0, 1024, "name:"}}) {
    const absl::Status refused =
        client->RegisterSystemRegion(r.name, r.key, r.offset, r.byte_size);
    EXPECT_FALSE(refused.ok()) << r.field;
    EXPECT_TRUE(absl::StartsWith(refused.message(), r.field))
        << r.field << ": " << refused;
  }
  // The server goes on serving.
  auto fine = client->Score(Request(3, 1));
  ASSERT_TRUE(fine.ok()) << fine.status();
  ASSERT_TRUE(client->UnregisterSystemRegion("").ok());
}

TEST_F(LogpClientRegionsTest, ACpuServerRefusesCudaRegionsNamingTheField) {
  auto client = Connect(*server_);
  const std::string handle(client::CudaRuntime::kIpcHandleBytes, '\x01');
  // Well formed: this server computes on the CPU.
  const absl::Status cpu = client->RegisterCudaRegion("g", handle, 0, 1 << 20);
  EXPECT_EQ(cpu.code(), absl::StatusCode::kFailedPrecondition) << cpu;
  EXPECT_TRUE(absl::StrContains(cpu.message(), "CPU")) << cpu;
  struct Registration {
    std::string name, handle;
    int64_t device, byte_size;
    std::string field;
  };
  for (const Registration& r :
       std::vector<Registration>{{"bad name!", handle, 0, 1024, "name:"},
                                 {"g", "", 0, 1024, "raw_handle:"},
                                 {"g", handle, -1, 1024, "device_id:"},
                                 {"g", handle, 0, 0, "byte_size:"}}) {
    const absl::Status refused =
        client->RegisterCudaRegion(r.name, r.handle, r.device, r.byte_size);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_TRUE(absl::StartsWith(refused.message(), r.field))
        << r.field << ": " << refused;
  }
  auto status = client->CudaRegionStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->regions_size(), 0);
  const absl::Status none = client->UnregisterCudaRegion("g");
  EXPECT_EQ(none.code(), absl::StatusCode::kNotFound) << none;
}

TEST(LogpClientDeviceRowsTest, BadRowsAreRefusedNamingTheField) {
  LogpClient::Options options;
  options.target = "127.0.0.1:1";  // never reached
  auto client = *LogpClient::Create(options);
  int word = 0;
  client::DeviceRows rows;
  rows.data = &word;
  rows.rows = 2;
  rows.hidden_size = 8;
  const std::vector<int64_t> two = {1, 2};
  struct Case {
    client::DeviceRows rows;
    std::vector<int64_t> targets;
    std::string field;
  };
  client::DeviceRows null_data = rows, no_rows = rows, bad_dtype = rows;
  null_data.data = nullptr;
  no_rows.rows = 0;
  bad_dtype.dtype = v1::DTYPE_UNSPECIFIED;
  for (const Case& c : std::vector<Case>{{null_data, two, "rows.data:"},
                                         {no_rows, {}, "rows.rows"},
                                         {bad_dtype, two, "rows.dtype:"},
                                         {rows, {1, 2, 3}, "targets:"}}) {
    auto refused = client->Score(c.rows, c.targets, {});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << refused.status();
    EXPECT_TRUE(absl::StartsWith(refused.status().message(), c.field))
        << c.field << ": " << refused.status();
  }
}

TEST(LogpClientDeviceRowsTest, WithoutACudaRuntimeDeviceRowsCannotBeRead) {
  LogpClient::Options options;
  options.target = "127.0.0.1:1";  // never reached
  options.cuda_shared_memory = true;
  options.cuda_runtime.libraries = {"libdetlogp_no_such_cudart.so"};
  auto client = *LogpClient::Create(options);
  int word = 0;
  client::DeviceRows rows;
  rows.data = &word;
  rows.rows = 1;
  rows.hidden_size = 2;
  auto refused = client->Score(rows, {0}, {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(
      refused.status().message(),
      "rows.data: rows on a GPU cannot be read without the CUDA runtime"))
      << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                "libdetlogp_no_such_cudart.so"))
      << refused.status();

  // The default libraries: none here, or one with no GPU, or a GPU that
  // does not hold this host pointer; each says so naming rows.data.
  options.cuda_runtime = {};
  auto host_rows = (*LogpClient::Create(options))->Score(rows, {0}, {});
  EXPECT_FALSE(host_rows.ok());
  EXPECT_TRUE(absl::StartsWith(host_rows.status().message(), "rows.data: "))
      << host_rows.status();
}

TEST(LogpClientSystemRegionTest, ARegionTheServerReleasedIsRegisteredAgain) {
  auto server = ServerProcess::Start(ServerArgs({"--shared_memory_idle_s=1"}));
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options options;
  options.system_shared_memory = true;
  auto client = Connect(**server, options);
  auto plain = Connect(**server);
  const LogProbRequest request = Request(40, 3);
  auto first = client->Score(request);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->path, "system_shm") << client->shared_memory_refusal();
  // Unused for a second, the server releases it.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  int regions = 1;
  while (regions > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(100));
    auto status = plain->SystemRegionStatus();
    ASSERT_TRUE(status.ok()) << status.status();
    regions = status->regions_size();
  }
  ASSERT_EQ(regions, 0);
  auto again = client->Score(request);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->path, "system_shm");
  ExpectSameBits(*first, *again);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

// A call of 32 MiB through the client's region is written piece by piece
// as its requests go: by default 4 pieces of 8 MiB, all in flight on 2
// connections (two requests outstanding on each); pieces of at least 4 MiB
// make 8 on 4 connections, of 16 MiB 2 on one; every way with the bits of
// the same rows sent in one message each. A narrow vocabulary keeps the
// CPU's work small.
TEST(LogpClientSystemRegionTest, ALargeCallIsWrittenIntoTheRegionInPieces) {
  constexpr int64_t kNarrowVocab = 64;
  constexpr int64_t kRows = 65536;  // 32 MiB of bf16 rows of kHidden
  auto server = ServerProcess::Start(
      {"--device=cpu", absl::StrCat("--synthetic_hidden_size=", kHidden),
       absl::StrCat("--synthetic_vocab_size=", kNarrowVocab)});
  ASSERT_TRUE(server.ok()) << server.status();
  auto plain = Connect(**server);
  const LogProbRequest request = client::MakeLogProbRequest(
      "pieces", v1::DTYPE_BFLOAT16, kRows, kHidden,
      client::RandomBf16Rows(kRows, kHidden, 21),
      client::RandomTargets(kRows, kNarrowVocab, 21), Extras());
  auto in_messages = plain->Score(request);
  ASSERT_TRUE(in_messages.ok()) << in_messages.status();
  EXPECT_EQ(in_messages->path, "grpc");
  struct Pieces {
    int64_t piece_bytes;  // 0: the default
    int requests;
    int connections;
  };
  for (const Pieces& want : {Pieces{0, 8, 4}, Pieces{int64_t{8} << 20, 4, 2},
                             Pieces{int64_t{16} << 20, 2, 1}}) {
    LogpClient::Options options;
    options.system_shared_memory = true;
    if (want.piece_bytes > 0) options.region_piece_bytes = want.piece_bytes;
    auto client = Connect(**server, options);
    auto through_region = client->Score(request);
    ASSERT_TRUE(through_region.ok()) << through_region.status();
    EXPECT_EQ(through_region->path, "system_shm")
        << client->shared_memory_refusal();
    EXPECT_EQ(through_region->requests, want.requests) << want.piece_bytes;
    EXPECT_EQ(through_region->connections, want.connections)
        << want.piece_bytes;
    ExpectSameBits(*in_messages, *through_region);
  }
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

// Calls from eight threads through one client's system regions: each has
// the bits of the same rows as bytes, and the client never holds more than
// `regions` regions on the server.
void ScoreAtOnceThroughSystemRegions(const ServerProcess& server, int regions,
                                     int expected_regions) {
  constexpr int kThreads = 8;
  constexpr int kCallsEach = 4;
  auto plain = Connect(server);
  std::vector<LogProbRequest> requests;
  std::vector<ScoreResult> wanted;
  for (int i = 0; i < kThreads * kCallsEach; ++i) {
    requests.push_back(Request(200 + 37 * i, 100 + i));
    auto answer = plain->Score(requests.back());
    ASSERT_TRUE(answer.ok()) << answer.status();
    wanted.push_back(*std::move(answer));
  }
  LogpClient::Options options;
  options.system_shared_memory = true;
  options.system_shared_memory_regions = regions;
  auto client = Connect(server, options);
  std::vector<absl::StatusOr<ScoreResult>> got(requests.size(),
                                               absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < static_cast<int>(requests.size()); i += kThreads) {
        got[i] = client->Score(requests[i]);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(client->shared_memory_refusal(), "");
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << i << ": " << got[i].status();
    EXPECT_EQ(got[i]->path, "system_shm") << i;
    ExpectSameBits(wanted[i], *got[i]);
  }
  auto status = plain->SystemRegionStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_GE(status->regions_size(), 1);
  EXPECT_LE(status->regions_size(), expected_regions);
  client.reset();  // unregisters them
  status = plain->SystemRegionStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->regions_size(), 0);
}

TEST_F(LogpClientRegionsTest, CallsAtOnceHaveSystemRegionsOfTheirOwn) {
  ScoreAtOnceThroughSystemRegions(*server_, 3, 3);
}

TEST(LogpClientSystemRegionTest, TheServersByteBoundLowersTheRegionsHeld) {
  // Room for one 2 MiB region: calls at once wait for it rather than turn
  // regions off.
  auto server = ServerProcess::Start(
      ServerArgs({absl::StrCat("--max_shared_memory_bytes=", 3 << 20)}));
  ASSERT_TRUE(server.ok()) << server.status();
  ScoreAtOnceThroughSystemRegions(**server, 4, 1);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

TEST(LogpClientSystemRegionTest, ARefusedRegionFallsBackOnceAndSaysSo) {
  // Less than one region's 2 MiB: the first registration is refused.
  auto server = ServerProcess::Start(
      ServerArgs({absl::StrCat("--max_shared_memory_bytes=", 1 << 20)}));
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options options;
  options.system_shared_memory = true;
  auto client = Connect(**server, options);
  auto plain = Connect(**server);
  for (int call = 0; call < 2; ++call) {
    const LogProbRequest request = Request(300, 20 + call);
    auto wanted = plain->Score(request);
    ASSERT_TRUE(wanted.ok()) << wanted.status();
    auto got = client->Score(request);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->path, "grpc") << "call " << call;
    EXPECT_EQ(got->path_refused, "system_shm") << "call " << call;
    EXPECT_FALSE(got->used_shared_memory);
    ExpectSameBits(*wanted, *got);
  }
  EXPECT_TRUE(absl::StartsWith(client->shared_memory_refusal(), "system: "))
      << client->shared_memory_refusal();
  // Registered once: the refusal turned the path off, nothing was retried.
  auto text = (*server)->HttpGet("/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::string series =
      "detlogp_requests_total{method=\"SystemSharedMemoryRegister\",code=\"";
  int registrations = 0;
  for (size_t at = text->find(series); at != std::string::npos;
       at = text->find(series, at + 1)) {
    const size_t value = text->find("} ", at) + 2;
    registrations += std::stoi(text->substr(value));
  }
  EXPECT_EQ(registrations, 1) << *text;
  // A plain client's calls name no refused path.
  auto plain_call = plain->Score(Request(10, 3));
  ASSERT_TRUE(plain_call.ok());
  EXPECT_EQ(plain_call->path_refused, "");
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

TEST(LogpClientOptionsTest, AnEmptyReplicaIsRefusedByName) {
  LogpClient::Options options;
  options.targets = {"127.0.0.1:1", ""};
  auto client = LogpClient::Create(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.status().message(), "targets[1]: empty");
  options.targets = {"127.0.0.1:1"};
  options.replica_first_backoff = absl::ZeroDuration();
  client = LogpClient::Create(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      absl::StartsWith(client.status().message(), "replica_first_backoff"))
      << client.status();
}

TEST(LogpClientOptionsTest, ANonPositiveRegionCountIsRefusedByName) {
  LogpClient::Options options;
  options.system_shared_memory_regions = 0;
  auto client = LogpClient::Create(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(client.status().message(),
                               "system_shared_memory_regions:"))
      << client.status();
}

TEST_F(LogpClientRegionsTest, SpreadConnectionsAreKeptBetweenCalls) {
  LogpClient::Options options;
  options.connections = 4;
  options.max_request_rows = 100;
  options.spread_connection_idle_timeout = absl::Seconds(1);
  auto client = Connect(*server_, options);
  LogpClient::Options whole;
  whole.split_large_calls = false;
  const LogProbRequest request = Request(1234, 11);
  auto unsplit = Connect(*server_, whole)->Score(request);
  ASSERT_TRUE(unsplit.ok()) << unsplit.status();
  EXPECT_EQ(unsplit->requests, 1);

  for (int call = 0; call < 2; ++call) {
    auto spread = client->Score(request);
    ASSERT_TRUE(spread.ok()) << spread.status();
    EXPECT_EQ(spread->connections, 4);
    EXPECT_EQ(spread->requests, 13);
    ExpectSameBits(*unsplit, *spread);
    // The client's own connection and three kept beside it, opened once.
    EXPECT_EQ(client->spread_connections_opened(), 3) << "call " << call;
    EXPECT_EQ(client->spread_connections_connected(), 3) << "call " << call;
  }
  // Unused past the idle timeout, the kept connections close by themselves.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (client->spread_connections_connected() > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(client->spread_connections_connected(), 0);
  // The next call reconnects them: no new channels.
  auto after_idle = client->Score(request);
  ASSERT_TRUE(after_idle.ok()) << after_idle.status();
  ExpectSameBits(*unsplit, *after_idle);
  EXPECT_EQ(client->spread_connections_opened(), 3);

  // Calls at once each take their own connections.
  std::vector<std::thread> callers;
  std::vector<absl::StatusOr<ScoreResult>> answers(3);
  for (int i = 0; i < 3; ++i) {
    callers.emplace_back([&, i] { answers[i] = client->Score(request); });
  }
  for (std::thread& caller : callers) caller.join();
  for (const auto& answer : answers) {
    ASSERT_TRUE(answer.ok()) << answer.status();
    ExpectSameBits(*unsplit, *answer);
  }
  EXPECT_GE(client->spread_connections_opened(), 3);
  EXPECT_LE(client->spread_connections_opened(), 9);
}

TEST_F(LogpClientRegionsTest, SpreadRequestsOfAtMostTheirBytesHaveUnsplitBits) {
  LogpClient::Options whole;
  whole.split_large_calls = false;
  const LogProbRequest request = Request(1234, 19);
  auto unsplit = Connect(*server_, whole)->Score(request);
  ASSERT_TRUE(unsplit.ok()) << unsplit.status();
  // 100 rows per request, over two connections, one to three at once each.
  for (int in_flight : {1, 2, 3}) {
    LogpClient::Options options;
    options.connections = 2;
    options.spread_request_bytes = 100 * kHidden * 2;
    options.spread_requests_in_flight = in_flight;
    auto spread = Connect(*server_, options)->Score(request);
    ASSERT_TRUE(spread.ok()) << spread.status();
    EXPECT_EQ(spread->requests, 13) << in_flight;
    EXPECT_EQ(spread->connections, 2) << in_flight;
    ExpectSameBits(*unsplit, *spread);
  }
  // A bad row in a late request fails the call with the server's answer.
  LogProbRequest bad = request;
  bad.set_target_ids(1100, kVocab);
  LogpClient::Options options;
  options.connections = 2;
  options.spread_request_bytes = 100 * kHidden * 2;
  auto refused = Connect(*server_, options)->Score(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
      << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "target_ids"))
      << refused.status();
}

TEST_F(LogpClientRegionsTest, ACallsDeadlineCoversEveryRequestItIsCutInto) {
  const LogProbRequest request = Request(6000, 23);
  LogpClient::Options cut;
  cut.connections = 1;
  cut.max_request_rows = 100;
  LogpClient::Options spread;
  spread.connections = 2;
  spread.spread_request_bytes = 100 * kHidden * 2;
  for (const LogpClient::Options& options : {cut, spread}) {
    auto client = Connect(*server_, options);
    auto late = client->Score(request, absl::Now() + absl::Milliseconds(2));
    EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded)
        << late.status();
    auto in_time = client->Score(request, absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(in_time.ok()) << in_time.status();
    EXPECT_EQ(in_time->requests, 60);
  }
}

TEST(LogpClientOptionsTest, BadSpreadSettingsAreRefusedByName) {
  for (const auto& [field, set] : std::vector<
           std::pair<std::string, std::function<void(LogpClient::Options&)>>>{
           {"connections", [](auto& o) { o.connections = -1; }},
           {"spread_request_bytes",
            [](auto& o) { o.spread_request_bytes = 0; }},
           {"spread_requests_in_flight",
            [](auto& o) { o.spread_requests_in_flight = 0; }},
           {"region_piece_bytes", [](auto& o) { o.region_piece_bytes = 0; }}}) {
    LogpClient::Options options;
    set(options);
    auto client = LogpClient::Create(options);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(client.status().message(), field + ":"))
        << client.status();
  }
}

TEST_F(LogpClientRegionsTest, ACallCutOnOneConnectionHasTheBitsOfUnsplitRows) {
  LogpClient::Options whole;
  whole.split_large_calls = false;
  const LogProbRequest request = Request(1234, 13);
  auto unsplit = Connect(*server_, whole)->Score(request);
  ASSERT_TRUE(unsplit.ok()) << unsplit.status();
  LogpClient::Options cut;
  cut.connections = 1;
  cut.max_request_rows = 100;
  auto client = Connect(*server_, cut);
  auto sliced = client->Score(request);
  ASSERT_TRUE(sliced.ok()) << sliced.status();
  EXPECT_EQ(sliced->requests, 13);
  EXPECT_EQ(sliced->connections, 1);
  ExpectSameBits(*unsplit, *sliced);
  // Bytes that do not fill the shape are not cut: the server names them.
  LogProbRequest short_rows = request;
  short_rows.mutable_hidden()->mutable_data()->resize(1234 * kHidden * 2 - 2);
  auto refused = client->Score(short_rows);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "hidden.data:"))
      << refused.status();
}

TEST_F(LogpClientRegionsTest, RowsGivenBesideTheRequestHaveTheBitsOfRowsInIt) {
  const LogProbRequest request = Request(1234, 17);
  LogProbRequest header = request;
  header.mutable_hidden()->clear_data();
  const std::string& rows = request.hidden().data();
  auto whole = Connect(*server_)->Score(request);
  ASSERT_TRUE(whole.ok()) << whole.status();
  // Alone, cut on one connection, and spread over three.
  for (const auto& [connections, max_rows] :
       std::vector<std::pair<int, int64_t>>{{1, 0}, {1, 100}, {3, 100}}) {
    LogpClient::Options options;
    options.connections = connections;
    options.max_request_rows = max_rows;
    auto beside = Connect(*server_, options)->Score(header, rows);
    ASSERT_TRUE(beside.ok()) << beside.status();
    EXPECT_EQ(beside->requests, max_rows == 0 ? 1 : 13);
    EXPECT_EQ(beside->connections, connections);
    ExpectSameBits(*whole, *beside);
  }
  auto client = Connect(*server_);
  auto short_rows =
      client->Score(header, absl::string_view(rows).substr(0, rows.size() - 2));
  EXPECT_EQ(short_rows.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(short_rows.status().message(), "hidden.data:"))
      << short_rows.status();
  auto rows_twice = client->Score(request, rows);
  EXPECT_EQ(rows_twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(rows_twice.status().message(), "hidden:"))
      << rows_twice.status();
}

TEST_F(LogpClientRegionsTest, TheCliRepeatsACallOnOneClient) {
  auto [code, out] = testing::RunCli(
      absl::StrCat("score --target=", server_->target(),
                   " --random_rows=5 --score_repeats=3 --timing 2>&1"));
  ASSERT_EQ(code, 0) << out;
  int timing_lines = 0, row_lines = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    timing_lines += absl::StartsWith(line, "timing build_us ");
    row_lines += absl::StartsWith(line, "row ");
  }
  EXPECT_EQ(timing_lines, 3) << out;
  EXPECT_EQ(row_lines, 5) << out;
  auto [zero_code, zero] = testing::RunCli(absl::StrCat(
      "score --target=", server_->target(), " --score_repeats=0 2>&1"));
  EXPECT_EQ(zero_code, 1) << zero;
  EXPECT_TRUE(absl::StrContains(zero, "--score_repeats=0")) << zero;
}

TEST_F(LogpClientRegionsTest, TheCliSaysWhyRowsOnTheGpuTookAnotherPath) {
  // Here without a GPU the upload fails naming the flag; on a GPU host this
  // CPU server refuses the CUDA region and the rows come back through the
  // host, which the CLI says.
  auto [code, out] = testing::RunCli(
      absl::StrCat("score --target=", server_->target(),
                   " --random_rows=3 --cuda_shared_memory --timing 2>&1"));
  if (code == 0) {
    EXPECT_TRUE(absl::StrContains(out,
                                  "cuda_shm not used (path grpc): cuda: "
                                  "FAILED_PRECONDITION"))
        << out;
    EXPECT_TRUE(absl::StrContains(out, " path grpc\n")) << out;
  } else {
    EXPECT_EQ(code, 1) << out;
    EXPECT_TRUE(absl::StrContains(out, "--cuda_shared_memory: ")) << out;
  }
}

}  // namespace
}  // namespace detlogp
