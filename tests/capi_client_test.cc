// The C ABI of the C++ client (client/capi/detlogp_client.h) against the
// real server binary (CPU backend, a small synthetic model) on loopback:
// options refused by the field or key they name, a call cut to the server's
// row limit with the bits of the same rows in small calls, through the
// messages and through the client's system region, and asynchronous calls
// (more at once than the client has threads) each called back once with
// the blocking call's answer or its error and details. Needs no GPU.
#include "client/capi/detlogp_client.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/random_rows.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using testing::ServerProcess;

constexpr int64_t kHidden = 128;
constexpr int64_t kVocab = 1024;
constexpr int64_t kMaxRequestRows = 64;
constexpr int kBf16 = 2;  // detlogp.v1.DTYPE_BFLOAT16

class CapiClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start(
        {"--device=cpu", absl::StrCat("--synthetic_hidden_size=", kHidden),
         absl::StrCat("--synthetic_vocab_size=", kVocab),
         absl::StrCat("--max_request_rows=", kMaxRequestRows)});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    target_ = server_->target();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(SIGTERM), 0);
    }
    delete server_;
    server_ = nullptr;
  }

  // Options for the test's server; `targets` kept alive by the fixture.
  DetlogpClientOptions Options() {
    DetlogpClientOptions options{};
    targets_ = {target_.c_str()};
    options.targets = targets_.data();
    options.target_count = 1;
    options.timeout_s = 60;
    return options;
  }

  // The client, or a failure naming why not.
  DetlogpClient* Create(const DetlogpClientOptions& options) {
    DetlogpClient* client = nullptr;
    char error[512] = {0};
    const int code =
        detlogp_client_create(&options, &client, error, sizeof(error));
    EXPECT_EQ(code, 0) << error;
    return client;
  }

  static ServerProcess* server_;
  static std::string target_;
  std::vector<const char*> targets_;
};
ServerProcess* CapiClientTest::server_ = nullptr;
std::string CapiClientTest::target_;

// A call's rows and the arrays its answer is written to.
struct Call {
  Call(int64_t rows, uint64_t seed)
      : hidden(client::RandomBf16Rows(rows, kHidden, seed)),
        targets(client::RandomTargets(rows, kVocab, seed)),
        logprobs(rows),
        lse(rows) {
    request.dtype = kBf16;
    request.rows = rows;
    request.hidden_size = kHidden;
    request.hidden = hidden.data();
    request.device = -1;
    request.target_ids = targets.data();
    request.return_lse = 1;
    answer.logprobs = logprobs.data();
    answer.lse = lse.data();
  }
  std::string hidden;
  std::vector<int64_t> targets;
  std::vector<float> logprobs;
  std::vector<float> lse;
  DetlogpScoreRequest request{};
  DetlogpScoreAnswer answer{};
};

std::string Bits(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     values.size() * sizeof(float));
}

int Score(DetlogpClient* client, Call& call, std::string* error_text) {
  char error[512] = {0};
  const int code = detlogp_client_score(client, &call.request, &call.answer,
                                        error, sizeof(error));
  *error_text = error;
  return code;
}

// logprobs and lse of `call`'s rows sent kMaxRequestRows at a time.
std::pair<std::string, std::string> InSmallCalls(DetlogpClient* client,
                                                 const Call& call) {
  std::string logprobs, lse;
  const int64_t row_bytes = kHidden * 2;
  for (int64_t begin = 0; begin < call.request.rows; begin += kMaxRequestRows) {
    const int64_t rows = std::min(kMaxRequestRows, call.request.rows - begin);
    Call part(rows, 0);
    part.hidden = call.hidden.substr(begin * row_bytes, rows * row_bytes);
    part.targets.assign(call.targets.begin() + begin,
                        call.targets.begin() + begin + rows);
    part.request.hidden = part.hidden.data();
    part.request.target_ids = part.targets.data();
    std::string error;
    EXPECT_EQ(Score(client, part, &error), 0) << error;
    EXPECT_EQ(part.answer.requests, 1);
    logprobs += Bits(part.logprobs);
    lse += Bits(part.lse);
  }
  return {logprobs, lse};
}

TEST_F(CapiClientTest, SaysItsAbiVersion) {
  EXPECT_EQ(detlogp_client_abi_version(), 6);
  EXPECT_EQ(DETLOGP_CLIENT_ABI_VERSION, 6);
}

TEST_F(CapiClientTest, RefusesOptionsNamingTheFieldOrKey) {
  char error[512];
  DetlogpClient* client = nullptr;
  auto refused = [&](const DetlogpClientOptions& options) {
    error[0] = '\0';
    const int code =
        detlogp_client_create(&options, &client, error, sizeof(error));
    EXPECT_EQ(client, nullptr);
    return std::make_pair(code, std::string(error));
  };
  DetlogpClientOptions none = Options();
  none.target_count = 0;
  auto [code, text] = refused(none);
  EXPECT_EQ(code, 3);  // INVALID_ARGUMENT
  EXPECT_TRUE(absl::StartsWith(text, "targets: 0 given")) << text;

  const char* empty[] = {""};
  DetlogpClientOptions blank = Options();
  blank.targets = empty;
  EXPECT_EQ(refused(blank).second, "targets[0]: empty");
  const char* second_empty[] = {target_.c_str(), ""};
  DetlogpClientOptions pair = Options();
  pair.targets = second_empty;
  pair.target_count = 2;
  EXPECT_EQ(refused(pair).second, "targets[1]: empty");

  DetlogpChannelArg args[] = {{"grpc.keepalive_time_ms", 20000, nullptr},
                              {"grpc.primary_user_agent", 0, "x"}};
  DetlogpClientOptions unknown = Options();
  unknown.channel_args = args;
  unknown.channel_arg_count = 2;
  std::tie(code, text) = refused(unknown);
  EXPECT_EQ(code, 3);
  EXPECT_TRUE(
      absl::StartsWith(text, "channel_args: \"grpc.primary_user_agent\""))
      << text;

  DetlogpChannelArg huge[] = {
      {"grpc.keepalive_time_ms", int64_t{1} << 40, nullptr}};
  DetlogpClientOptions out_of_range = Options();
  out_of_range.channel_args = huge;
  out_of_range.channel_arg_count = 1;
  EXPECT_TRUE(
      absl::StrContains(refused(out_of_range).second, "out of int range"));
}

TEST_F(CapiClientTest, ACallIsCutAndHasTheBitsOfSmallCallsEitherPath) {
  DetlogpChannelArg args[] = {{"grpc.keepalive_time_ms", 20000, nullptr},
                              {"grpc.lb_policy_name", 0, "pick_first"}};
  DetlogpClientOptions plain_options = Options();
  plain_options.channel_args = args;
  plain_options.channel_arg_count = 2;
  DetlogpClient* plain = Create(plain_options);
  DetlogpClientOptions region_options = Options();
  region_options.system_shared_memory = 1;
  DetlogpClient* region = Create(region_options);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(region, nullptr);

  Call through_messages(10 * kMaxRequestRows + 7, 11);
  Call through_region(10 * kMaxRequestRows + 7, 11);
  std::string error;
  ASSERT_EQ(Score(plain, through_messages, &error), 0) << error;
  ASSERT_EQ(Score(region, through_region, &error), 0) << error;
  EXPECT_STREQ(through_messages.answer.path, "grpc");
  EXPECT_STREQ(through_region.answer.path, "system_shm");
  EXPECT_EQ(through_messages.answer.requests, 11);
  EXPECT_EQ(through_region.answer.requests, 11);
  const auto [logprobs, lse] = InSmallCalls(plain, through_messages);
  EXPECT_EQ(Bits(through_messages.logprobs), logprobs);
  EXPECT_EQ(Bits(through_messages.lse), lse);
  EXPECT_EQ(Bits(through_region.logprobs), logprobs);
  EXPECT_EQ(Bits(through_region.lse), lse);
  detlogp_client_destroy(plain);
  detlogp_client_destroy(region);
}

// What one asynchronous call was told, once.
struct Outcome {
  absl::Mutex mu;
  int calls ABSL_GUARDED_BY(mu) = 0;
  int code ABSL_GUARDED_BY(mu) = -1;
  std::string message ABSL_GUARDED_BY(mu);
};

void Done(void* user_data, int code, const char* message) {
  auto* outcome = static_cast<Outcome*>(user_data);
  absl::MutexLock lock(&outcome->mu);
  ++outcome->calls;
  outcome->code = code;
  outcome->message = message;
}

TEST_F(CapiClientTest, AsynchronousCallsAreCalledBackOnceWithTheAnswer) {
  DetlogpClientOptions options = Options();
  options.async_threads = 2;  // fewer than the calls: the rest wait
  DetlogpClient* client = Create(options);
  ASSERT_NE(client, nullptr);
  constexpr int kCalls = 6;
  std::vector<std::unique_ptr<Call>> calls;
  std::vector<Outcome> outcomes(kCalls + 1);
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<Call>(3 * kMaxRequestRows + i, 20 + i));
  }
  // The last one names a token beyond the vocabulary: its error, with the
  // server's details, comes through the callback.
  calls.push_back(std::make_unique<Call>(3 * kMaxRequestRows, 40));
  calls.back()->targets[2 * kMaxRequestRows + 1] = kVocab;
  for (size_t i = 0; i < calls.size(); ++i) {
    char error[256] = {0};
    ASSERT_EQ(detlogp_client_score_async(client, &calls[i]->request,
                                         &calls[i]->answer, &Done, &outcomes[i],
                                         error, sizeof(error)),
              0)
        << error;
  }
  char error[256] = {0};
  EXPECT_EQ(
      detlogp_client_score_async(client, &calls[0]->request, &calls[0]->answer,
                                 nullptr, nullptr, error, sizeof(error)),
      3);
  EXPECT_STREQ(error, "done: null");
  // Destroying the client waits for every call taken, callbacks included.
  detlogp_client_destroy(client);

  DetlogpClient* blocking = Create(Options());
  for (int i = 0; i < kCalls; ++i) {
    absl::MutexLock lock(&outcomes[i].mu);
    EXPECT_EQ(outcomes[i].calls, 1);
    EXPECT_EQ(outcomes[i].code, 0) << outcomes[i].message;
    Call again(calls[i]->request.rows, 20 + i);
    std::string text;
    ASSERT_EQ(Score(blocking, again, &text), 0) << text;
    EXPECT_EQ(Bits(calls[i]->logprobs), Bits(again.logprobs)) << i;
    EXPECT_EQ(Bits(calls[i]->lse), Bits(again.lse)) << i;
  }
  {
    Outcome& failed = outcomes[kCalls];
    absl::MutexLock lock(&failed.mu);
    EXPECT_EQ(failed.calls, 1);
    EXPECT_EQ(failed.code, 3) << failed.message;
    EXPECT_TRUE(absl::StrContains(
        failed.message, absl::StrCat("target_ids[", 2 * kMaxRequestRows + 1)))
        << failed.message;
    EXPECT_GT(calls.back()->answer.error_details_len, 0);
  }
  detlogp_client_destroy(blocking);
}

}  // namespace
}  // namespace detlogp
