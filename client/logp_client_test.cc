// LogpClient's request builder and its check of answers against requests
// (no server: the responses are written by hand).
#include "client/logp_client.h"

#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace detlogp::client {
namespace {

using detlogp::v1::LogProbRequest;
using detlogp::v1::LogProbResponse;

LogProbRequest Request(int64_t rows, bool lse, bool entropy, int64_t top_k) {
  LogProbOptions options;
  options.return_lse = lse;
  options.return_entropy = entropy;
  options.top_k = top_k;
  return MakeLogProbRequest("r", detlogp::v1::DTYPE_BFLOAT16, rows, 4,
                            std::string(rows * 4 * 2, '\0'),
                            std::vector<int64_t>(rows, 1), options);
}

// A response of the sizes `request` asks for.
LogProbResponse Answer(const LogProbRequest& request) {
  LogProbResponse response;
  const int64_t rows = request.target_ids_size();
  for (int64_t r = 0; r < rows; ++r) {
    response.add_logprobs(-1.0f - r);
    if (request.return_lse()) response.add_lse(2.0f);
    if (request.return_entropy()) response.add_entropy(0.5f + r);
    for (int64_t j = 0; j < request.top_k(); ++j) {
      response.add_top_ids(100 * r + j);
      response.add_top_logprobs(-0.1f * (j + 1));
    }
  }
  return response;
}

TEST(MakeLogProbRequestTest, CarriesEntropyAndTopK) {
  LogProbOptions options;
  options.temperature = 0.5f;
  options.return_entropy = true;
  options.top_k = 7;
  options.model = "policy";
  options.model_version = 3;
  const LogProbRequest request =
      MakeLogProbRequest("id", detlogp::v1::DTYPE_FLOAT32, 2, 3,
                         std::string(24, '\0'), {4, 5}, options);
  EXPECT_TRUE(request.return_entropy());
  EXPECT_EQ(request.top_k(), 7);
  EXPECT_FALSE(request.return_lse());
  EXPECT_EQ(request.temperature(), 0.5f);
  EXPECT_EQ(request.model(), "policy");
  EXPECT_EQ(request.model_version(), 3);
  EXPECT_EQ(request.target_ids_size(), 2);
  EXPECT_EQ(request.hidden().shape(0), 2);
}

TEST(MakeLogProbRequestTest, FormerSignatureAsksForNeither) {
  const LogProbRequest request =
      MakeLogProbRequest("id", detlogp::v1::DTYPE_FLOAT32, 1, 3,
                         std::string(12, '\0'), {4}, 1.0f, true, "m", 2);
  EXPECT_TRUE(request.return_lse());
  EXPECT_FALSE(request.return_entropy());
  EXPECT_EQ(request.top_k(), 0);
  EXPECT_EQ(request.model(), "m");
  EXPECT_EQ(request.model_version(), 2);
}

TEST(ToScoreResultTest, ExposesEntropyAndTopKRowMajor) {
  const LogProbRequest request = Request(3, false, true, 4);
  absl::StatusOr<ScoreResult> result = ToScoreResult(request, Answer(request));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->top_k, 4);
  ASSERT_EQ(result->entropy.size(), 3u);
  EXPECT_EQ(result->entropy[2], 2.5f);
  ASSERT_EQ(result->top_ids.size(), 12u);
  ASSERT_EQ(result->top_logprobs.size(), 12u);
  EXPECT_EQ(result->top_ids[2 * 4 + 1], 201);
  EXPECT_TRUE(result->lse.empty());
}

TEST(ToScoreResultTest, NeitherAskedLeavesThemEmpty) {
  const LogProbRequest request = Request(2, true, false, 0);
  absl::StatusOr<ScoreResult> result = ToScoreResult(request, Answer(request));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->top_k, 0);
  EXPECT_TRUE(result->entropy.empty());
  EXPECT_TRUE(result->top_ids.empty());
  EXPECT_TRUE(result->top_logprobs.empty());
  EXPECT_EQ(result->lse.size(), 2u);
}

TEST(ToScoreResultTest, ZeroRowsWithTopK) {
  const LogProbRequest request = Request(0, false, true, 5);
  absl::StatusOr<ScoreResult> result = ToScoreResult(request, Answer(request));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->top_k, 5);
  EXPECT_TRUE(result->top_ids.empty());
}

// Each malformed response is DATA_LOSS whose message starts with its field.
TEST(CheckLogProbResponseTest, NamesTheFieldOfTheWrongSize) {
  const LogProbRequest request = Request(3, true, true, 2);
  struct Case {
    const char* field;
    void (*damage)(LogProbResponse*);
  };
  const Case cases[] = {
      {"logprobs",
       [](LogProbResponse* r) { r->mutable_logprobs()->RemoveLast(); }},
      {"lse", [](LogProbResponse* r) { r->add_lse(1.0f); }},
      {"entropy",
       [](LogProbResponse* r) { r->mutable_entropy()->RemoveLast(); }},
      {"entropy", [](LogProbResponse* r) { r->clear_entropy(); }},
      {"top_ids", [](LogProbResponse* r) { r->add_top_ids(9); }},
      {"top_ids", [](LogProbResponse* r) { r->clear_top_ids(); }},
      {"top_logprobs",
       [](LogProbResponse* r) { r->mutable_top_logprobs()->RemoveLast(); }},
  };
  for (const Case& c : cases) {
    LogProbResponse response = Answer(request);
    c.damage(&response);
    const absl::Status status = CheckLogProbResponse(request, response);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << c.field;
    EXPECT_TRUE(absl::StartsWith(status.message(), std::string(c.field) + ":"))
        << c.field << ": " << status;
    EXPECT_FALSE(ToScoreResult(request, response).ok()) << c.field;
  }
}

TEST(CheckLogProbResponseTest, ExtrasNotAskedForAreRefused) {
  const LogProbRequest request = Request(2, false, false, 0);
  LogProbResponse response = Answer(request);
  response.add_entropy(1.0f);
  response.add_entropy(1.0f);
  EXPECT_TRUE(absl::StartsWith(
      CheckLogProbResponse(request, response).message(), "entropy:"));
  response.clear_entropy();
  response.add_top_ids(1);
  response.add_top_ids(2);
  EXPECT_TRUE(absl::StartsWith(
      CheckLogProbResponse(request, response).message(), "top_ids:"));
}

TEST(ToScoreResultTest, UncheckedInfersTopK) {
  const LogProbRequest request = Request(3, false, false, 5);
  const ScoreResult result = ToScoreResult(Answer(request));
  EXPECT_EQ(result.top_k, 5);
  EXPECT_EQ(ToScoreResult(LogProbResponse()).top_k, 0);
}

// SerializeWithRows's bytes, parsed back.
LogProbRequest Parse(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  LogProbRequest parsed;
  EXPECT_TRUE(parsed.ParseFromString(bytes));
  return parsed;
}

TEST(SerializeWithRowsTest, ParsesAsTheSliceWithItsBytes) {
  LogProbOptions extras;
  extras.temperature = 0.7f;
  extras.return_lse = true;
  extras.return_entropy = true;
  extras.top_k = 3;
  extras.model = "policy";
  extras.model_version = 12;
  extras.return_timing = true;
  std::string rows(37 * 5 * 4, '\0');
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<char>(i * 7);
  std::vector<int64_t> targets;
  for (int64_t r = 0; r < 37; ++r) targets.push_back(1000 * r + 1);
  for (const LogProbOptions& options : {LogProbOptions(), extras}) {
    for (const auto dtype :
         {detlogp::v1::DTYPE_FLOAT32, detlogp::v1::DTYPE_BFLOAT16}) {
      const int64_t hidden_size = dtype == detlogp::v1::DTYPE_FLOAT32 ? 5 : 10;
      const LogProbRequest request = MakeLogProbRequest(
          "id", dtype, 37, hidden_size, rows, targets, options);
      for (const auto& [begin, count] :
           std::vector<std::pair<int64_t, int64_t>>{
               {0, 37}, {5, 20}, {36, 1}}) {
        const LogProbRequest slice = SliceLogProbRequest(request, begin, count);
        LogProbRequest header = slice;
        header.mutable_hidden()->clear_data();
        const LogProbRequest parsed =
            Parse(SerializeWithRows(header, slice.hidden().data()));
        EXPECT_EQ(parsed.SerializeAsString(), slice.SerializeAsString())
            << begin << "+" << count << ": " << parsed.ShortDebugString();
        EXPECT_EQ(parsed.hidden().data(), slice.hidden().data());
      }
    }
  }
  // A header's own bytes are left out; no rows: no data field.
  LogProbRequest header = MakeLogProbRequest("id", detlogp::v1::DTYPE_BFLOAT16,
                                             0, 4, "", {}, LogProbOptions());
  EXPECT_EQ(Parse(SerializeWithRows(header, "")).SerializeAsString(),
            header.SerializeAsString());
  header.mutable_hidden()->set_data("ignored");
  EXPECT_EQ(Parse(SerializeWithRows(header, "kept")).hidden().data(), "kept");
}

// A child forked after the library started gRPC's threads: every call that
// would need them fails at once with FAILED_PRECONDITION instead of waiting
// forever (no server is needed: the refusal comes before any connection).
TEST(LogpClientForkTest, EveryCallInAForkedChildIsRefusedAtOnce) {
  LogpClient::Options options;
  options.target = "127.0.0.1:1";  // nothing listens: never reached
  absl::StatusOr<std::unique_ptr<LogpClient>> client =
      LogpClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Exit code: one bit per call that was not refused as it should be.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    auto refused = [](const absl::Status& status) {
      return status.code() == absl::StatusCode::kFailedPrecondition &&
             absl::StrContains(status.message(), "fork");
    };
    int wrong = 0;
    if (!refused((*client)->GetModelInfo().status())) wrong |= 1;
    const LogProbRequest request = Request(2, false, false, 0);
    if (!refused((*client)->ScoreStream({request}, deadline).status()))
      wrong |= 2;
    if (!refused((*client)->Project(std::vector<float>(96), 1).status()))
      wrong |= 4;
    if (!refused(LogpClient::Create(options).status())) wrong |= 8;
    _exit(wrong);  // no destructors: the parent's threads are not ours
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "calls not refused (1 info, 2 stream, 4 project, 8 create)";
}

}  // namespace
}  // namespace detlogp::client
