// Shared-memory regions end to end: the real server binary (CPU backend, a
// small synthetic model, bearer tokens) on loopback, regions created by this
// process, and requests that name them.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/client_context.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "client/system_shared_memory.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
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
constexpr char kAlpha[] = "alpha-token";
constexpr char kBeta[] = "beta-token";

std::string TokensFile() {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path =
      absl::StrCat(dir != nullptr ? dir : "/tmp", "/shm_tokens.txt");
  std::ofstream(path) << kAlpha << "\n" << kBeta << "\n";
  return path;
}

std::vector<std::string> ServerArgs(std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "--device=cpu", absl::StrCat("--synthetic_hidden_size=", kHidden),
      absl::StrCat("--synthetic_vocab_size=", kVocab),
      "--auth_tokens_file=" + TokensFile(), "--metrics_port=0"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// A region's calls, with a token.
class Regions {
 public:
  Regions(const std::string& target, std::string token)
      : stub_(v1::SharedMemoryService::NewStub(
            grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))),
        token_(std::move(token)) {}

  grpc::Status Register(const std::string& name, const std::string& key,
                        int64_t offset, int64_t bytes) {
    v1::SystemSharedMemoryRegisterRequest request;
    request.set_name(name);
    request.set_key(key);
    request.set_offset(offset);
    request.set_byte_size(bytes);
    v1::SystemSharedMemoryRegisterResponse response;
    auto context = Context();
    return stub_->SystemSharedMemoryRegister(context.get(), request, &response);
  }
  grpc::Status Unregister(const std::string& name) {
    v1::SystemSharedMemoryUnregisterRequest request;
    request.set_name(name);
    v1::SystemSharedMemoryUnregisterResponse response;
    auto context = Context();
    return stub_->SystemSharedMemoryUnregister(context.get(), request,
                                               &response);
  }
  grpc::Status Status(const std::string& name,
                      v1::SystemSharedMemoryStatusResponse* response) {
    v1::SystemSharedMemoryStatusRequest request;
    request.set_name(name);
    auto context = Context();
    return stub_->SystemSharedMemoryStatus(context.get(), request, response);
  }

 private:
  std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->AddMetadata("authorization", absl::StrCat("Bearer ", token_));
    return context;
  }
  std::unique_ptr<v1::SharedMemoryService::Stub> stub_;
  std::string token_;
};

std::unique_ptr<LogpClient> Connect(const ServerProcess& server,
                                    const std::string& token,
                                    bool shared_memory = false) {
  LogpClient::Options options;
  options.target = server.target();
  options.bearer_token = token;
  options.system_shared_memory = shared_memory;
  return *LogpClient::Create(options);
}

// `rows` random bf16 rows with every extra asked for.
LogProbRequest Request(int64_t rows, uint64_t seed) {
  client::LogProbOptions options;
  options.return_lse = true;
  options.return_entropy = true;
  options.top_k = 5;
  options.temperature = 0.7f;
  return client::MakeLogProbRequest(
      absl::StrCat("r", seed), v1::DTYPE_BFLOAT16, rows, kHidden,
      client::RandomBf16Rows(rows, kHidden, seed),
      client::RandomTargets(rows, kVocab, seed), options);
}

// The same request naming `bytes` at `offset` of `region` for its rows.
LogProbRequest ByReference(LogProbRequest request, const std::string& region,
                           int64_t offset) {
  const int64_t bytes = static_cast<int64_t>(request.hidden().data().size());
  request.mutable_hidden()->clear_data();
  v1::SharedMemoryRef* ref = request.mutable_hidden()->mutable_shared_memory();
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(bytes);
  return request;
}

// A metric's value from /metrics, or -1.
double Metric(const ServerProcess& server, const std::string& series) {
  auto text = server.HttpGet("/metrics");
  if (!text.ok()) return -1;
  const std::string prefix = "\n" + series + " ";
  const size_t at = text->find(prefix);
  if (at == std::string::npos) return -1;
  return std::strtod(text->c_str() + at + prefix.size(), nullptr);
}

// Whether the server process maps the shared-memory object `key`.
bool ServerMaps(const ServerProcess& server, const std::string& key) {
  std::ifstream maps(absl::StrCat("/proc/", server.pid(), "/maps"));
  std::stringstream text;
  text << maps.rdbuf();
  return absl::StrContains(text.str(), "/dev/shm" + key);
}

class SharedMemoryServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start(
        ServerArgs({"--max_shared_memory_bytes=67108864"}));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(SIGTERM), 0) << server_->Log();
    delete server_;
  }
  static ServerProcess* server_;
};
ServerProcess* SharedMemoryServerTest::server_ = nullptr;

TEST_F(SharedMemoryServerTest, BitsAreTheSameOverGrpcAndSystemSharedMemory) {
  auto grpc_client = Connect(*server_, kAlpha);
  Regions regions(server_->target(), kAlpha);
  auto shm = SystemSharedMemory::Create(1 << 20);
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(regions.Register("bits", (*shm)->key(), 4096, 1 << 19).ok());
  for (const int64_t rows : {1, 37, 300}) {
    const LogProbRequest request = Request(rows, 100 + rows);
    // An odd offset inside the region: rows need no alignment.
    const int64_t offset = 1001;
    std::memcpy((*shm)->data() + 4096 + offset, request.hidden().data().data(),
                request.hidden().data().size());
    auto over_grpc = grpc_client->Score(request);
    auto over_shm = grpc_client->Score(ByReference(request, "bits", offset));
    ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
    ASSERT_TRUE(over_shm.ok()) << over_shm.status();
    ExpectSameBits(*over_grpc, *over_shm);
  }
  // fp32 rows are converted on the server the same way from either place.
  const int64_t rows = 9;
  std::string fp32(rows * kHidden * 4, '\0');
  const std::string bf16 = client::RandomBf16Rows(rows, kHidden, 7);
  for (int64_t i = 0; i < rows * kHidden; ++i) {
    const uint32_t bits =
        static_cast<uint32_t>(static_cast<uint16_t>(bf16[2 * i] & 0xff) |
                              static_cast<uint16_t>(bf16[2 * i + 1] << 8))
        << 16;
    std::memcpy(&fp32[4 * i], &bits, 4);
  }
  const LogProbRequest fp32_request = client::MakeLogProbRequest(
      "fp32", v1::DTYPE_FLOAT32, rows, kHidden, fp32,
      client::RandomTargets(rows, kVocab, 7), 1.0f, true);
  std::memcpy((*shm)->data() + 4096, fp32.data(), fp32.size());
  auto a = grpc_client->Score(fp32_request);
  auto b = grpc_client->Score(ByReference(fp32_request, "bits", 0));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_TRUE(SameBits(a->logprobs, b->logprobs));
  EXPECT_TRUE(SameBits(a->lse, b->lse));
  EXPECT_GT(Metric(*server_, "detlogp_hidden_bytes_total{path=\"system_shm\"}"),
            0);
  ASSERT_TRUE(regions.Unregister("bits").ok());
}

TEST_F(SharedMemoryServerTest, TheClientsOwnRegionGivesTheSameBits) {
  auto grpc_client = Connect(*server_, kAlpha);
  auto shm_client = Connect(*server_, kAlpha, /*shared_memory=*/true);
  for (const int64_t rows : {3, 513}) {
    const LogProbRequest request = Request(rows, 200 + rows);
    auto over_grpc = grpc_client->Score(request);
    auto over_shm = shm_client->Score(request);
    ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
    ASSERT_TRUE(over_shm.ok()) << over_shm.status();
    EXPECT_TRUE(over_shm->used_shared_memory)
        << shm_client->shared_memory_refusal();
    EXPECT_FALSE(over_grpc->used_shared_memory);
    ExpectSameBits(*over_grpc, *over_shm);
  }
  // The client unlinked its object once registered: nothing is left in
  // /dev/shm for a killed client to leak.
  Regions regions(server_->target(), kAlpha);
  v1::SystemSharedMemoryStatusResponse status;
  ASSERT_TRUE(regions.Status("", &status).ok());
  ASSERT_EQ(status.regions_size(), 1);
  EXPECT_NE(access(("/dev/shm" + status.regions(0).key()).c_str(), F_OK), 0);
  EXPECT_EQ(status.regions(0).use().requests(), 2);
  shm_client.reset();  // unregisters
  ASSERT_TRUE(regions.Status("", &status).ok());
  EXPECT_EQ(status.regions_size(), 0);
}

TEST_F(SharedMemoryServerTest, LargeCallsAreCutAndSpreadSameBits) {
  // A server that takes at most 100 rows per request.
  auto server = ServerProcess::Start(ServerArgs({"--max_request_rows=100"}));
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server, kAlpha);
  auto info = client->GetModelInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->max_request_rows(), 100);
  EXPECT_EQ(info->max_receive_message_bytes(), int64_t{640} << 20);
  const LogProbRequest request = Request(1234, 3);
  for (const bool shared_memory : {false, true}) {
    auto cut = Connect(**server, kAlpha, shared_memory)->Score(request);
    ASSERT_TRUE(cut.ok()) << cut.status();
    EXPECT_EQ(cut->requests, 13);
    EXPECT_EQ(cut->used_shared_memory, shared_memory);
    // Against 100-row requests sent one by one.
    std::vector<ScoreResult> parts;
    for (int64_t begin = 0; begin < 1234; begin += 100) {
      auto part = client->Score(client::SliceLogProbRequest(
          request, begin, std::min<int64_t>(100, 1234 - begin)));
      ASSERT_TRUE(part.ok()) << part.status();
      parts.push_back(*std::move(part));
    }
    ExpectSameBits(client::JoinScoreResults(std::move(parts)), *cut);
  }
  // Spread over four connections: the same requests side by side, the same
  // bits, one version.
  LogpClient::Options spread;
  spread.target = (*server)->target();
  spread.bearer_token = kAlpha;
  spread.connections = 4;
  auto over_four = (*LogpClient::Create(spread))->Score(request);
  ASSERT_TRUE(over_four.ok()) << over_four.status();
  EXPECT_EQ(over_four->connections, 4);
  EXPECT_EQ(over_four->requests, 13);
  auto on_one = client->Score(request);
  ASSERT_TRUE(on_one.ok()) << on_one.status();
  EXPECT_EQ(on_one->connections, 1);  // 1234 rows of H=256: under 8 MiB
  ExpectSameBits(*on_one, *over_four);
  EXPECT_EQ(over_four->model_version, on_one->model_version);
  LogpClient::Options whole;
  whole.target = (*server)->target();
  whole.bearer_token = kAlpha;
  whole.split_large_calls = false;
  EXPECT_EQ((*LogpClient::Create(whole))->Score(request).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

TEST_F(SharedMemoryServerTest, BadReferencesAreRefusedNamingTheField) {
  auto client = Connect(*server_, kAlpha);
  Regions regions(server_->target(), kAlpha);
  auto shm = SystemSharedMemory::Create(64 << 10);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(regions.Register("refs", (*shm)->key(), 0, 32 << 10).ok());
  const LogProbRequest good = Request(4, 1);
  const int64_t bytes = 4 * kHidden * 2;
  struct Case {
    std::string what;
    std::function<void(LogProbRequest*)> edit;
    absl::StatusCode code;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"unknown region",
       [](LogProbRequest* r) {
         r->mutable_hidden()->mutable_shared_memory()->set_region("nope");
       },
       absl::StatusCode::kNotFound, "hidden.shared_memory.region:"},
      {"negative offset",
       [](LogProbRequest* r) {
         r->mutable_hidden()->mutable_shared_memory()->set_offset(-2);
       },
       absl::StatusCode::kInvalidArgument, "hidden.shared_memory.offset:"},
      {"offset past the end",
       [](LogProbRequest* r) {
         r->mutable_hidden()->mutable_shared_memory()->set_offset(40 << 10);
       },
       absl::StatusCode::kInvalidArgument, "hidden.shared_memory.offset:"},
      {"rows past the end",
       [](LogProbRequest* r) {
         r->mutable_hidden()->mutable_shared_memory()->set_offset((32 << 10) -
                                                                  100);
       },
       absl::StatusCode::kInvalidArgument, "hidden.shared_memory.byte_size:"},
      {"byte_size not the shape's",
       [bytes](LogProbRequest* r) {
         r->mutable_hidden()->mutable_shared_memory()->set_byte_size(bytes - 2);
       },
       absl::StatusCode::kInvalidArgument, "hidden.shared_memory.byte_size:"},
      {"data and a reference",
       [](LogProbRequest* r) { r->mutable_hidden()->set_data("xx"); },
       absl::StatusCode::kInvalidArgument, "hidden.data:"},
  };
  for (const Case& c : cases) {
    LogProbRequest request = ByReference(good, "refs", 0);
    c.edit(&request);
    auto result = client->Score(request);
    ASSERT_FALSE(result.ok()) << c.what;
    EXPECT_EQ(result.status().code(), c.code)
        << c.what << ": " << result.status();
    EXPECT_TRUE(absl::StartsWith(result.status().message(), c.field))
        << c.what << ": " << result.status();
    EXPECT_TRUE(client->Score(good).ok()) << "after " << c.what;
  }
  // Bad registrations name theirs, and the registered region still serves.
  struct Registration {
    std::string name, key;
    int64_t offset, bytes;
    grpc::StatusCode code;
    std::string field;
  };
  for (const Registration& r : std::vector<Registration>{
           {"bad name!", (*shm)->key(), 0, 16,
            grpc::StatusCode::INVALID_ARGUMENT, "name:"},
           {"r2", "/detlogp_no_such_object", 0, 16, grpc::StatusCode::NOT_FOUND,
            "key:"},
           {"r2", (*shm)->key(), 0, 1 << 20, grpc::StatusCode::INVALID_ARGUMENT,
            "byte_size:"},
           {"r2", (*shm)->key(), -4, 16, grpc::StatusCode::INVALID_ARGUMENT,
            "offset:"},
           {"refs", (*shm)->key(), 0, 16, grpc::StatusCode::ALREADY_EXISTS,
            "name:"},
       }) {
    const grpc::Status s = regions.Register(r.name, r.key, r.offset, r.bytes);
    EXPECT_EQ(s.error_code(), r.code) << r.name << ": " << s.error_message();
    EXPECT_TRUE(absl::StartsWith(s.error_message(), r.field))
        << s.error_message();
  }
  std::memcpy((*shm)->data(), good.hidden().data().data(), bytes);
  auto by_ref = client->Score(ByReference(good, "refs", 0));
  ASSERT_TRUE(by_ref.ok()) << by_ref.status();
  ExpectSameBits(*client->Score(good), *by_ref);
  ASSERT_TRUE(regions.Unregister("refs").ok());
  EXPECT_EQ(regions.Unregister("refs").error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(SharedMemoryServerTest, ARegionIsOnlyItsTokens) {
  Regions alpha(server_->target(), kAlpha);
  Regions beta(server_->target(), kBeta);
  auto shm = SystemSharedMemory::Create(64 << 10);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(alpha.Register("mine", (*shm)->key(), 0, 64 << 10).ok());
  const LogProbRequest good = Request(2, 5);
  std::memcpy((*shm)->data(), good.hidden().data().data(),
              good.hidden().data().size());
  EXPECT_TRUE(
      Connect(*server_, kAlpha)->Score(ByReference(good, "mine", 0)).ok());
  auto stolen = Connect(*server_, kBeta)->Score(ByReference(good, "mine", 0));
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound)
      << stolen.status();
  EXPECT_TRUE(absl::StartsWith(stolen.status().message(),
                               "hidden.shared_memory.region:"));
  v1::SystemSharedMemoryStatusResponse listed;
  ASSERT_TRUE(beta.Status("", &listed).ok());
  EXPECT_EQ(listed.regions_size(), 0);
  EXPECT_EQ(beta.Status("mine", &listed).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(beta.Unregister("mine").error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(alpha.Status("mine", &listed).ok());
  ASSERT_EQ(listed.regions_size(), 1);
  EXPECT_EQ(listed.regions(0).use().requests(), 1);
  EXPECT_EQ(listed.limits().max_bytes(), 67108864);
  // No token at all is refused before anything else.
  Regions anonymous(server_->target(), "");
  EXPECT_EQ(anonymous.Register("x", (*shm)->key(), 0, 16).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(alpha.Unregister("").ok());
}

TEST_F(SharedMemoryServerTest, RegistrationsBeyondTheByteBoundAreRefused) {
  Regions regions(server_->target(), kAlpha);
  auto shm = SystemSharedMemory::Create(48 << 20);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(regions.Register("big1", (*shm)->key(), 0, 48 << 20).ok());
  const grpc::Status over =
      regions.Register("big2", (*shm)->key(), 0, 20 << 20);
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(
      absl::StrContains(over.error_message(), "--max_shared_memory_bytes"));
  ASSERT_TRUE(regions.Register("big2", (*shm)->key(), 0, 16 << 20).ok());
  EXPECT_EQ(Metric(*server_, "detlogp_shared_memory_bytes{kind=\"system\"}"),
            64 << 20);
  ASSERT_TRUE(regions.Unregister("").ok());
  EXPECT_EQ(Metric(*server_, "detlogp_shared_memory_regions{kind=\"system\"}"),
            0);
}

TEST_F(SharedMemoryServerTest, ARegionInUseIsNotUnregistered) {
  Regions regions(server_->target(), kAlpha);
  // Enough rows that the CPU takes a while over them.
  const int64_t rows = 16384;
  const LogProbRequest request = Request(rows, 11);
  auto shm = SystemSharedMemory::Create(request.hidden().data().size());
  ASSERT_TRUE(shm.ok());
  std::memcpy((*shm)->data(), request.hidden().data().data(),
              request.hidden().data().size());
  ASSERT_TRUE(regions.Register("busy", (*shm)->key(), 0, (*shm)->bytes()).ok());
  absl::StatusOr<ScoreResult> result;
  absl::Notification done;
  std::thread call([&] {
    result = Connect(*server_, kAlpha)->Score(ByReference(request, "busy", 0));
    done.Notify();
  });
  bool refused = false;
  while (!done.HasBeenNotified() && !refused) {
    v1::SystemSharedMemoryStatusResponse status;
    ASSERT_TRUE(regions.Status("busy", &status).ok());
    if (status.regions(0).use().requests_in_flight() == 0) continue;
    const grpc::Status busy = regions.Unregister("busy");
    if (busy.ok()) break;  // answered meanwhile
    EXPECT_EQ(busy.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_TRUE(absl::StrContains(busy.error_message(), "in flight"));
    refused = true;
  }
  call.join();
  EXPECT_TRUE(refused) << "the call ended before it was seen in flight";
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->logprobs.size(), static_cast<size_t>(rows));
  EXPECT_TRUE(regions.Unregister("busy").ok());
}

TEST_F(SharedMemoryServerTest, TimingSaysWhereTheCallsTimeWent) {
  LogProbRequest request = Request(64, 2);
  request.set_return_timing(true);
  auto result = Connect(*server_, kAlpha)->Score(request);
  ASSERT_TRUE(result.ok()) << result.status();
  const v1::ServerTiming& t = result->server_timing;
  EXPECT_GT(t.compute_us(), 0);
  EXPECT_GE(t.total_us(), t.validate_us() + t.queue_us() + t.compute_us());
  request.set_return_timing(false);
  auto untimed = Connect(*server_, kAlpha)->Score(request);
  ASSERT_TRUE(untimed.ok());
  EXPECT_EQ(untimed->server_timing.total_us(), 0);
}

// Shrinks the object `key` to `bytes`, as a careless or dying owner would.
void Truncate(const std::string& key, off_t bytes) {
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << key;
  ASSERT_EQ(ftruncate(fd, bytes), 0);
  close(fd);
}

// `rows` random rows as fp32 (bf16 values widened: exact both ways).
LogProbRequest Fp32Request(int64_t rows, uint64_t seed) {
  const std::string bf16 = client::RandomBf16Rows(rows, kHidden, seed);
  std::string fp32(rows * kHidden * 4, '\0');
  for (int64_t i = 0; i < rows * kHidden; ++i) {
    uint16_t half;
    std::memcpy(&half, &bf16[2 * i], 2);
    const uint32_t bits = static_cast<uint32_t>(half) << 16;
    std::memcpy(&fp32[4 * i], &bits, 4);
  }
  return client::MakeLogProbRequest(
      absl::StrCat("f", seed), v1::DTYPE_FLOAT32, rows, kHidden, fp32,
      client::RandomTargets(rows, kVocab, seed), 1.0f, true);
}

void ExpectRegionShrank(const absl::StatusOr<ScoreResult>& result,
                        const std::string& region) {
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition)
      << result.status();
  EXPECT_TRUE(absl::StartsWith(
      result.status().message(),
      absl::StrCat("hidden.shared_memory: region \"", region, "\" shrank")))
      << result.status();
}

// An owner that truncates its registered object makes its own requests
// fail, bf16 rows (read in the batch) and fp32 rows (decoded at validation)
// alike; the server goes on answering everyone else, with the same bits.
TEST_F(SharedMemoryServerTest, ARegionItsOwnerTruncatedFailsOnlyItsRequests) {
  auto client = Connect(*server_, kAlpha);
  Regions regions(server_->target(), kAlpha);
  auto shm = SystemSharedMemory::Create(1 << 20);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(regions.Register("shrinking", (*shm)->key(), 0, 1 << 20).ok());
  const LogProbRequest bf16 = Request(37, 40);
  const LogProbRequest fp32 = Fp32Request(9, 41);
  const int64_t bf16_at = 64 << 10;
  const int64_t fp32_at = 512 << 10;
  std::memcpy((*shm)->data() + bf16_at, bf16.hidden().data().data(),
              bf16.hidden().data().size());
  std::memcpy((*shm)->data() + fp32_at, fp32.hidden().data().data(),
              fp32.hidden().data().size());
  const LogProbRequest bf16_ref = ByReference(bf16, "shrinking", bf16_at);
  const LogProbRequest fp32_ref = ByReference(fp32, "shrinking", fp32_at);
  ASSERT_TRUE(client->Score(bf16_ref).ok());
  ASSERT_TRUE(client->Score(fp32_ref).ok());
  auto baseline = client->Score(bf16);
  ASSERT_TRUE(baseline.ok()) << baseline.status();

  Truncate((*shm)->key(), 4096);
  ExpectRegionShrank(client->Score(bf16_ref), "shrinking");
  ExpectRegionShrank(client->Score(fp32_ref), "shrinking");
  auto after = client->Score(bf16);
  ASSERT_TRUE(after.ok()) << after.status();
  ExpectSameBits(*baseline, *after);

  // Refused and good requests at once, from two callers.
  std::vector<absl::StatusOr<ScoreResult>> refused(10), answered(10);
  std::thread shrunk_caller([&] {
    auto own = Connect(*server_, kAlpha);
    for (auto& result : refused) result = own->Score(bf16_ref);
  });
  std::thread good_caller([&] {
    auto own = Connect(*server_, kAlpha);
    for (auto& result : answered) result = own->Score(bf16);
  });
  shrunk_caller.join();
  good_caller.join();
  for (const auto& result : refused) ExpectRegionShrank(result, "shrinking");
  for (const auto& result : answered) {
    ASSERT_TRUE(result.ok()) << result.status();
    ExpectSameBits(*baseline, *result);
  }
  ASSERT_TRUE(regions.Unregister("shrinking").ok());
}

// The truncation lands after the request was accepted, while it waits for
// its batch: the batch reads the vanished rows, fails that request only and
// answers the request that shared the batch.
TEST_F(SharedMemoryServerTest, ARegionTruncatedUnderAQueuedRequestFailsOnlyIt) {
  // Batches wait 2 s for rows, leaving time to truncate under a request.
  auto slow =
      ServerProcess::Start(ServerArgs({"--max_queue_delay_us=2000000"}));
  ASSERT_TRUE(slow.ok()) << slow.status();
  Regions regions((*slow)->target(), kAlpha);
  auto shm = SystemSharedMemory::Create(1 << 20);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(regions.Register("late", (*shm)->key(), 0, 1 << 20).ok());
  const LogProbRequest doomed = Request(5, 50);
  const int64_t at = 512 << 10;
  std::memcpy((*shm)->data() + at, doomed.hidden().data().data(),
              doomed.hidden().data().size());
  absl::StatusOr<ScoreResult> refused;
  std::thread doomed_caller([&] {
    refused = Connect(**slow, kAlpha)->Score(ByReference(doomed, "late", at));
  });
  // Accepted (validated, queued) once the region counts it in flight.
  bool queued = false;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!queued && absl::Now() < give_up) {
    v1::SystemSharedMemoryStatusResponse status;
    ASSERT_TRUE(regions.Status("late", &status).ok());
    queued = status.regions(0).use().requests_in_flight() == 1;
  }
  Truncate((*shm)->key(), 4096);
  const LogProbRequest good = Request(7, 51);
  absl::StatusOr<ScoreResult> answered;
  std::thread good_caller(
      [&] { answered = Connect(**slow, kAlpha)->Score(good); });
  doomed_caller.join();
  good_caller.join();
  ASSERT_TRUE(queued) << "the request was never seen in flight";
  ExpectRegionShrank(refused, "late");
  ASSERT_TRUE(answered.ok()) << answered.status();
  auto reference = Connect(*server_, kAlpha)->Score(good);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ExpectSameBits(*reference, *answered);
  ASSERT_TRUE(regions.Unregister("late").ok());
  // Alive throughout, and it stops cleanly.
  EXPECT_EQ((*slow)->Stop(SIGTERM), 0) << (*slow)->Log();
}

TEST(SharedMemoryIdleTest, AnAbandonedRegionIsReleased) {
  auto server = ServerProcess::Start(ServerArgs({"--shared_memory_idle_s=1"}));
  ASSERT_TRUE(server.ok()) << server.status();
  Regions regions((*server)->target(), kAlpha);
  std::string key;
  {
    // The client goes away without unregistering, as one killed would.
    auto shm = SystemSharedMemory::Create(1 << 20);
    ASSERT_TRUE(shm.ok());
    key = (*shm)->key();
    ASSERT_TRUE(regions.Register("left", key, 0, 1 << 20).ok());
    (*shm)->Unlink();
  }
  EXPECT_TRUE(ServerMaps(**server, key));
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  v1::SystemSharedMemoryStatusResponse status;
  do {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(regions.Status("", &status).ok());
  } while (status.regions_size() > 0 && absl::Now() < give_up);
  EXPECT_EQ(status.regions_size(), 0);
  EXPECT_EQ(status.limits().registered_bytes(), 0);
  EXPECT_FALSE(ServerMaps(**server, key));  // the memory is gone
  EXPECT_EQ(Metric(**server, "detlogp_shared_memory_idle_released_total"), 1);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

TEST(SharedMemoryOffTest, TheFlagOffRefusesRegionsAndReferences) {
  auto server =
      ServerProcess::Start(ServerArgs({"--allow_shared_memory=false"}));
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(absl::StrContains((*server)->Log(), "shared memory: off"));
  Regions regions((*server)->target(), kAlpha);
  auto shm = SystemSharedMemory::Create(64 << 10);
  ASSERT_TRUE(shm.ok());
  const grpc::Status refused = regions.Register("r", (*shm)->key(), 0, 1024);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(
      absl::StrContains(refused.error_message(), "--allow_shared_memory"));
  const LogProbRequest good = Request(2, 3);
  auto result = Connect(**server, kAlpha)->Score(ByReference(good, "r", 0));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(
      absl::StartsWith(result.status().message(), "hidden.shared_memory:"));
  // A client asking for shared memory falls back to bytes, and says why.
  auto client = Connect(**server, kAlpha, /*shared_memory=*/true);
  auto fallback = client->Score(good);
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_FALSE(fallback->used_shared_memory);
  EXPECT_TRUE(absl::StrContains(client->shared_memory_refusal(),
                                "--allow_shared_memory"));
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

// This host's first non-loopback IPv4 address, or "" when it has none.
std::string NonLoopbackAddress() {
  ifaddrs* addresses = nullptr;
  if (getifaddrs(&addresses) != 0) return "";
  std::string found;
  for (ifaddrs* a = addresses; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    const in_addr address =
        reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr;
    if ((ntohl(address.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN];
    if (inet_ntop(AF_INET, &address, text, sizeof(text)) != nullptr) {
      found = text;
    }
  }
  freeifaddrs(addresses);
  return found;
}

TEST(SharedMemoryPeerTest, OnlyCallersOnThisHostMayUseRegions) {
  const std::string address = NonLoopbackAddress();
  if (address.empty()) GTEST_SKIP() << "no non-loopback IPv4 address";
  // A short path: a Unix socket's holds at most 107 bytes.
  char dir[] = "/tmp/detlogp-shm-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string socket = absl::StrCat(dir, "/peer.sock");
  // Every address, shared memory asked for: callers through the host's own
  // non-loopback address are still refused.
  auto server = ServerProcess::Start(
      ServerArgs({"--host=0.0.0.0", "--allow_shared_memory=true",
                  "--unix_socket=" + socket}));
  ASSERT_TRUE(server.ok()) << server.status();
  auto shm = SystemSharedMemory::Create(64 << 10);
  ASSERT_TRUE(shm.ok());
  const LogProbRequest good = Request(2, 8);
  std::memcpy((*shm)->data(), good.hidden().data().data(),
              good.hidden().data().size());
  const std::string remote = absl::StrCat(address, ":", (*server)->port());
  Regions from_afar(remote, kAlpha);
  const grpc::Status refused = from_afar.Register("r", (*shm)->key(), 0, 4096);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << refused.error_message();
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "host"));
  // Through the Unix socket the same region is accepted, and usable from
  // loopback but not from afar.
  Regions local("unix:" + socket, kAlpha);
  ASSERT_TRUE(local.Register("r", (*shm)->key(), 0, 4096).ok());
  LogpClient::Options options;
  options.bearer_token = kAlpha;
  options.target = "unix:" + socket;
  EXPECT_TRUE(
      (*LogpClient::Create(options))->Score(ByReference(good, "r", 0)).ok());
  options.target = remote;
  auto afar = (*LogpClient::Create(options))->Score(ByReference(good, "r", 0));
  EXPECT_EQ(afar.status().code(), absl::StatusCode::kFailedPrecondition)
      << afar.status();
  EXPECT_TRUE(
      absl::StartsWith(afar.status().message(), "hidden.shared_memory:"));
  EXPECT_TRUE((*LogpClient::Create(options))->Score(good).ok());
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
  unlink(socket.c_str());
  rmdir(dir);
}

TEST(SharedMemoryOffTest, OnByDefaultForALoopbackListener) {
  auto server = ServerProcess::Start(ServerArgs());
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(absl::StrContains((*server)->Log(), "shared memory: on"))
      << (*server)->Log();
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace detlogp
