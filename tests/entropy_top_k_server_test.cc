// Entropy and top-k through the real server (CPU backend, embedded model)
// over gRPC: response fields, float64 references, bits of a row across mixed
// concurrent unary and streamed calls, the k prefix property, and
// INVALID_ARGUMENT for bad top_k and --max_top_k.
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/random_rows.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "server/models/lm_head_weights.h"
#include "tests/linear_logp_reference.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using testing::ServerProcess;
using v1::LogProbRequest;
using v1::LogProbResponse;

constexpr int64_t kH = 1024;
constexpr int64_t kV = 32000;

// Rows to score: bf16 bytes and targets, concatenated into requests.
struct Rows {
  std::string hidden;  // [n, kH] bf16
  std::vector<int64_t> targets;
  int64_t size() const { return static_cast<int64_t>(targets.size()); }
  Rows Row(int64_t r) const {
    return {hidden.substr(r * kH * 2, kH * 2), {targets[r]}};
  }
  void Append(const Rows& other) {
    hidden += other.hidden;
    targets.insert(targets.end(), other.targets.begin(), other.targets.end());
  }
};

Rows RandomRows(int64_t n, uint64_t seed) {
  return {client::RandomBf16Rows(n, kH, seed),
          client::RandomTargets(n, kV, seed)};
}

LogProbRequest MakeRequest(const Rows& rows, bool entropy, int64_t top_k,
                           float temperature = 1.0f) {
  LogProbRequest request;
  request.set_request_id(absl::StrCat("e", entropy, "k", top_k));
  v1::Tensor* hidden = request.mutable_hidden();
  hidden->set_dtype(v1::DTYPE_BFLOAT16);
  hidden->add_shape(rows.size());
  hidden->add_shape(kH);
  hidden->set_data(rows.hidden);
  for (int64_t t : rows.targets) request.add_target_ids(t);
  request.set_temperature(temperature);
  request.set_return_lse(true);
  request.set_return_entropy(entropy);
  request.set_top_k(top_k);
  return request;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

// One row's answer.
struct RowAnswer {
  float logprob = 0, lse = 0, entropy = 0;
  std::vector<int64_t> top_ids;
  std::vector<float> top_logprobs;
};

RowAnswer RowOf(const LogProbResponse& response, int64_t r, int64_t k) {
  RowAnswer row;
  row.logprob = response.logprobs(r);
  row.lse = response.lse(r);
  if (response.entropy_size() > 0) row.entropy = response.entropy(r);
  for (int64_t i = 0; i < k; ++i) {
    row.top_ids.push_back(response.top_ids(r * k + i));
    row.top_logprobs.push_back(response.top_logprobs(r * k + i));
  }
  return row;
}

// `got` (asked for entropy or not, k entries) against the row's answer with
// entropy and kMax >= k entries: equal bits, top list a prefix.
void ExpectSameRowBits(const RowAnswer& got, const RowAnswer& full,
                       bool entropy, int64_t k, const std::string& where) {
  EXPECT_TRUE(SameBits(got.logprob, full.logprob)) << where;
  EXPECT_TRUE(SameBits(got.lse, full.lse)) << where;
  if (entropy) {
    EXPECT_TRUE(SameBits(got.entropy, full.entropy)) << where;
  }
  ASSERT_EQ(static_cast<int64_t>(got.top_ids.size()), k) << where;
  for (int64_t i = 0; i < k; ++i) {
    EXPECT_EQ(got.top_ids[i], full.top_ids[i]) << where << " rank " << i;
    EXPECT_TRUE(SameBits(got.top_logprobs[i], full.top_logprobs[i]))
        << where << " rank " << i;
  }
}

class EntropyTopKServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start({"--device=cpu"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(SIGTERM), 0) << server_->Log();
    delete server_;
  }

  static std::unique_ptr<v1::LogProbService::Stub> Stub(
      const ServerProcess& server = *server_) {
    return v1::LogProbService::NewStub(grpc::CreateChannel(
        server.target(), grpc::InsecureChannelCredentials()));
  }

  static grpc::Status Score(v1::LogProbService::Stub* stub,
                            const LogProbRequest& request,
                            LogProbResponse* response) {
    grpc::ClientContext context;
    return stub->ComputeLogProbs(&context, request, response);
  }

  static ServerProcess* server_;
};
ServerProcess* EntropyTopKServerTest::server_ = nullptr;

TEST_F(EntropyTopKServerTest, FieldsAppearOnlyWhenAskedWithTheirShapes) {
  auto stub = Stub();
  const Rows rows = RandomRows(3, 1);
  for (bool entropy : {false, true}) {
    for (int64_t k : {0, 1, 7, 20}) {
      LogProbResponse response;
      const grpc::Status status =
          Score(stub.get(), MakeRequest(rows, entropy, k), &response);
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(response.logprobs_size(), 3);
      EXPECT_EQ(response.entropy_size(), entropy ? 3 : 0) << "k " << k;
      EXPECT_EQ(response.top_ids_size(), 3 * k) << "entropy " << entropy;
      EXPECT_EQ(response.top_logprobs_size(), 3 * k) << "entropy " << entropy;
    }
  }
}

TEST_F(EntropyTopKServerTest, AnswersMatchFloat64Reference) {
  const server::LmHeadWeights weights = server::SyntheticLmHead({});
  auto stub = Stub();
  const Rows rows = RandomRows(3, 2);
  const int64_t k = 20;
  LogProbResponse response;
  ASSERT_TRUE(
      Score(stub.get(), MakeRequest(rows, true, k, 0.8f), &response).ok());
  for (int64_t r = 0; r < 3; ++r) {
    const auto ref = testing::ReferenceEntropyAndRanking(
        weights.view(),
        reinterpret_cast<const uint16_t*>(rows.hidden.data()) + r * kH, 0.8);
    EXPECT_NEAR(response.entropy(r), ref.entropy, 2e-3) << "row " << r;
    for (int64_t i = 0; i < k; ++i) {
      const double z_i = ref.z[ref.ranked[i]];
      const bool gaps = (i == 0 || ref.z[ref.ranked[i - 1]] - z_i > 1e-4) &&
                        z_i - ref.z[ref.ranked[i + 1]] > 1e-4;
      if (gaps) {
        EXPECT_EQ(response.top_ids(r * k + i), ref.ranked[i]) << r << "/" << i;
      }
      EXPECT_NEAR(response.top_logprobs(r * k + i), z_i - ref.lse, 1e-3)
          << r << "/" << i;
    }
  }
}

TEST_F(EntropyTopKServerTest, TopThreeIsThePrefixOfTopTwentyBitwise) {
  auto stub = Stub();
  const Rows rows = RandomRows(5, 3);
  LogProbResponse top3, top20;
  ASSERT_TRUE(Score(stub.get(), MakeRequest(rows, false, 3), &top3).ok());
  ASSERT_TRUE(Score(stub.get(), MakeRequest(rows, true, 20), &top20).ok());
  for (int64_t r = 0; r < 5; ++r) {
    ExpectSameRowBits(RowOf(top3, r, 3), RowOf(top20, r, 20), false, 3,
                      absl::StrCat("row ", r));
  }
}

// Probe rows answered alone (entropy, top-20), then inside concurrent unary
// and streamed calls with neighbours, each call asking for a different mix:
// every probe keeps its bits, and asking for nothing leaves logprob and lse
// as they were.
TEST_F(EntropyTopKServerTest, RowBitsSurviveMixedConcurrentRequests) {
  const Rows probes = RandomRows(8, 4);
  std::vector<RowAnswer> alone;
  {
    auto stub = Stub();
    for (int64_t p = 0; p < probes.size(); ++p) {
      LogProbResponse response;
      ASSERT_TRUE(
          Score(stub.get(), MakeRequest(probes.Row(p), true, 20), &response)
              .ok());
      alone.push_back(RowOf(response, 0, 20));
    }
  }
  struct Mix {
    bool entropy;
    int64_t k;
  };
  const std::vector<Mix> mixes = {{true, 0},  {false, 3}, {true, 20},
                                  {false, 0}, {false, 1}, {true, 5}};
  constexpr int kThreads = 6;
  constexpr int kCallsPerThread = 4;
  absl::Mutex mu;
  std::vector<std::string> failures;
  auto fail = [&](std::string what) {
    absl::MutexLock lock(&mu);
    failures.push_back(std::move(what));
  };
  // Checks the probe at `position` of an answer to a call of mix `mix`.
  auto check = [&](const LogProbResponse& response, const Mix& mix, int64_t n,
                   int64_t position, int64_t p, const std::string& where) {
    if (response.logprobs_size() != n ||
        response.entropy_size() != (mix.entropy ? n : 0) ||
        response.top_ids_size() != n * mix.k ||
        response.top_logprobs_size() != n * mix.k) {
      return fail(where + ": wrong field sizes");
    }
    const RowAnswer got = RowOf(response, position, mix.k);
    const RowAnswer& want = alone[p];
    bool same = SameBits(got.logprob, want.logprob) &&
                SameBits(got.lse, want.lse) &&
                (!mix.entropy || SameBits(got.entropy, want.entropy));
    for (int64_t i = 0; i < mix.k; ++i) {
      same = same && got.top_ids[i] == want.top_ids[i] &&
             SameBits(got.top_logprobs[i], want.top_logprobs[i]);
    }
    if (!same) fail(where + ": probe bits changed");
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto stub = Stub();
      for (int c = 0; c < kCallsPerThread; ++c) {
        const int64_t p = (t * kCallsPerThread + c) % probes.size();
        const Mix mix = mixes[(t + c) % mixes.size()];
        // The probe at a varying position among 1..40 neighbours.
        const int64_t neighbours = 1 + (t * 13 + c * 7) % 40;
        const int64_t position = (t + 3 * c) % (neighbours + 1);
        const Rows others = RandomRows(neighbours, 1000 + t * 100 + c);
        Rows rows = RandomRows(0, 0);
        for (int64_t r = 0; r < position; ++r) rows.Append(others.Row(r));
        rows.Append(probes.Row(p));
        for (int64_t r = position; r < neighbours; ++r)
          rows.Append(others.Row(r));
        const std::string where = absl::StrCat("thread ", t, " call ", c);
        const LogProbRequest request = MakeRequest(rows, mix.entropy, mix.k);
        LogProbResponse response;
        if (c % 2 == 0) {
          const grpc::Status status = Score(stub.get(), request, &response);
          if (!status.ok()) return fail(where + ": " + status.error_message());
          check(response, mix, rows.size(), position, p, where);
          continue;
        }
        // A stream: the probe's request between two of another mix.
        grpc::ClientContext context;
        auto stream = stub->StreamLogProbs(&context);
        const Mix other = mixes[(t + c + 1) % mixes.size()];
        const LogProbRequest filler =
            MakeRequest(others, other.entropy, other.k);
        stream->Write(filler);
        stream->Write(request);
        stream->Write(filler);
        stream->WritesDone();
        std::vector<LogProbResponse> answers;
        while (stream->Read(&response)) answers.push_back(response);
        const grpc::Status status = stream->Finish();
        if (!status.ok() || answers.size() != 3) {
          return fail(where + ": stream " + status.error_message());
        }
        check(answers[1], mix, rows.size(), position, p, where + " (stream)");
        if (answers[0].top_ids_size() != others.size() * other.k ||
            answers[0].entropy_size() != (other.entropy ? others.size() : 0)) {
          fail(where + ": stream filler field sizes");
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_TRUE(failures.empty())
      << failures.size()
      << " failures, first: " << (failures.empty() ? "" : failures.front());
}

TEST_F(EntropyTopKServerTest, BadTopKIsInvalidArgumentNamingTheField) {
  auto stub = Stub();
  const Rows rows = RandomRows(2, 5);
  for (int64_t bad :
       {int64_t{-1}, int64_t{21}, int64_t{33}, int64_t{1} << 40}) {
    LogProbResponse response;
    const grpc::Status status =
        Score(stub.get(), MakeRequest(rows, true, bad), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_NE(status.error_message().find("top_k"), std::string::npos)
        << status.error_message();
    if (bad > 0) {
      EXPECT_NE(status.error_message().find("20"), std::string::npos)
          << "names no limit: " << status.error_message();
    }
  }
  // In a stream: earlier answers arrive, then the stream ends naming top_k.
  grpc::ClientContext context;
  auto stream = stub->StreamLogProbs(&context);
  stream->Write(MakeRequest(rows, true, 4));
  stream->Write(MakeRequest(rows, false, -3));
  stream->WritesDone();
  LogProbResponse response;
  int answers = 0;
  while (stream->Read(&response)) {
    ++answers;
    EXPECT_EQ(response.top_ids_size(), 8);
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(answers, 1);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("top_k"), std::string::npos);
  // Still serving.
  EXPECT_TRUE(Score(stub.get(), MakeRequest(rows, true, 20), &response).ok());
}

TEST_F(EntropyTopKServerTest, MaxTopKFlagSetsTheLimitAndIsCheckedAtStartUp) {
  auto bad = ServerProcess::Start({"--device=cpu", "--max_top_k=33"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--max_top_k=33"), std::string::npos)
      << bad.status();
  EXPECT_FALSE(ServerProcess::Start({"--device=cpu", "--max_top_k=-1"}).ok());

  auto server = ServerProcess::Start({"--device=cpu", "--max_top_k=5"});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_NE((*server)->Log().find("top_k up to 5"), std::string::npos);
  auto stub = Stub(**server);
  const Rows rows = RandomRows(2, 6);
  LogProbResponse response;
  EXPECT_TRUE(Score(stub.get(), MakeRequest(rows, false, 5), &response).ok());
  const grpc::Status status =
      Score(stub.get(), MakeRequest(rows, false, 6), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("top_k"), std::string::npos);
  EXPECT_NE(status.error_message().find("5 (--max_top_k)"), std::string::npos)
      << status.error_message();
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace detlogp
