// One version for the whole fleet: two-phase publish (staged on every
// replica, then committed on all, or aborted on all), staged versions that
// time out, pushes under load, and a replica that pulls the current version
// from a peer before it reports ready. Real server processes (CPU backend,
// small lm_heads; docs/live_weights.md).
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/logp_client.h"
#include "client/model_repository_client.h"
#include "client/random_rows.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "kernels/bfloat16.h"
#include "kernels/random_normal.h"
#include "proto/status_details.h"
#include "tests/assert_ok.h"
#include "tests/fleet_test_heads.h"
#include "tests/lm_head_test_files.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LmHeadUpload;
using client::LogpClient;
using client::ModelRepositoryClient;
using client::PushOptions;
using client::PushReport;
using testing::BytesReceived;
using testing::Latest;
using testing::MakeTempDir;
using testing::RandomLmHead;
using testing::Repo;
using testing::ServerProcess;
using testing::Step;
using testing::WriteLmHeadFile;
using v1::ModelVersionStatus;

constexpr int64_t kH = testing::kFleetHidden;
constexpr int64_t kV = testing::kFleetVocab;
// One version of [2000, 128] bf16 + fp32 bias is 520000 bytes on the CPU
// backend: a replica bounded to this holds one version, never two.
constexpr char kRoomForOneVersion[] = "--max_model_memory_bytes=700000";

// Every version of "policy" on the server, by number.
std::map<int64_t, ModelVersionStatus> Versions(const ServerProcess& server) {
  std::map<int64_t, ModelVersionStatus> out;
  auto models = Repo(server)->ListModels();
  EXPECT_TRUE(models.ok()) << models.status();
  if (!models.ok()) return out;
  for (const auto& info : models->models()) {
    if (info.model() != "policy") continue;
    for (const auto& version : info.versions())
      out[version.version()] = version;
  }
  return out;
}

v1::LogProbRequest FixedRequest(int64_t version) {
  const int64_t rows = 8;
  return client::MakeLogProbRequest("bits", v1::DTYPE_BFLOAT16, rows, kH,
                                    client::RandomBf16Rows(rows, kH, 3),
                                    client::RandomTargets(rows, kV, 4), 1.0f,
                                    /*return_lse=*/true, "policy", version);
}

// (version, logprob and lse bits) of fixed rows scored on `version` (0:
// the latest), or the error.
struct Scored {
  int64_t version = 0;
  std::vector<uint32_t> bits;
};
absl::StatusOr<Scored> Score(LogpClient& client, int64_t version) {
  auto result = client.Score(FixedRequest(version));
  if (!result.ok()) return result.status();
  Scored out;
  out.version = result->model_version;
  for (size_t r = 0; r < result->logprobs.size(); ++r) {
    uint32_t lp, lse;
    std::memcpy(&lp, &result->logprobs[r], 4);
    std::memcpy(&lse, &result->lse[r], 4);
    out.bits.push_back(lp);
    out.bits.push_back(lse);
  }
  return out;
}

std::unique_ptr<LogpClient> ScoringClient(const ServerProcess& server) {
  LogpClient::Options options;
  options.target = server.target();
  return *LogpClient::Create(options);
}

class TwoPhasePublishTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("two_phase");
    base_ = RandomLmHead(1);
    ASSERT_OK(WriteLmHeadFile(dir_ + "/v1.safetensors", base_));
  }

  std::unique_ptr<ServerProcess> Start(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {
        "--device=cpu", "--bias_tensor=lm_head.bias",
        "--max_versions_per_model=4", "--metrics_port=0",
        "--model=policy=" + dir_ + "/v1.safetensors"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto server = ServerProcess::Start(args, 60);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }

  std::string dir_;
  LmHeadUpload base_;
};

TEST_F(TwoPhasePublishTest, OneReplicaFailingToStageAbortsThePushEverywhere) {
  auto a = Start();
  auto b = Start();
  auto full = Start({kRoomForOneVersion});
  ASSERT_TRUE(a != nullptr && b != nullptr && full != nullptr);
  const std::vector<std::string> fleet = {a->target(), b->target(),
                                          full->target()};
  auto before = Score(*ScoringClient(*a), 0);
  ASSERT_TRUE(before.ok()) << before.status();
  const LmHeadUpload next = Step(base_, 2);

  for (PushOptions::Fanout fanout :
       {PushOptions::Fanout::kDirect, PushOptions::Fanout::kChain}) {
    PushOptions push;
    push.fanout = fanout;
    const PushReport report =
        client::PushToTargets(fleet, LogpClient::Options(), {}, next, push);
    EXPECT_EQ(report.status.code(), absl::StatusCode::kAborted)
        << report.status;
    EXPECT_FALSE(report.committed);
    EXPECT_EQ(report.targets[2].version.status().code(),
              absl::StatusCode::kResourceExhausted)
        << report.targets[2].version.status();
    for (int i : {0, 1}) {
      EXPECT_EQ(report.targets[i].version.status().code(),
                absl::StatusCode::kAborted)
          << report.targets[i].version.status();
    }
    // Every replica serves what it served; nothing is left staged.
    for (const ServerProcess* server : {a.get(), b.get(), full.get()}) {
      EXPECT_EQ(Latest(*server), 1) << server->target();
      const auto versions = Versions(*server);
      EXPECT_EQ(versions.size(), 1u) << server->target();
      auto now = Score(*ScoringClient(*server), 0);
      ASSERT_TRUE(now.ok()) << now.status();
      EXPECT_EQ(now->version, 1);
      EXPECT_EQ(now->bits, before->bits) << server->target();
      // The aborted number is not servable, pinned or not.
      auto pinned = Score(*ScoringClient(*server), 2);
      EXPECT_EQ(pinned.status().code(), absl::StatusCode::kNotFound);
    }
  }
  // A commit of the aborted version finds nothing.
  auto late = Repo(*a)->CommitVersion("policy", 2, "");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound) << late.status();
}

TEST_F(TwoPhasePublishTest, PushCommitsOneNumberAndDigestOnEveryReplica) {
  std::vector<std::unique_ptr<ServerProcess>> fleet;
  std::vector<std::string> targets;
  for (int i = 0; i < 3; ++i) {
    fleet.push_back(Start());
    ASSERT_TRUE(fleet.back() != nullptr);
    targets.push_back(fleet.back()->target());
  }
  const LmHeadUpload next = Step(base_, 2);
  auto delta = client::EncodeLmHeadDelta(next, base_, 1);
  ASSERT_TRUE(delta.ok()) << delta.status();
  PushOptions push;
  push.fanout = PushOptions::Fanout::kChain;
  push.delta = &*delta;
  const PushReport report =
      client::PushToTargets(targets, LogpClient::Options(), {}, next, push);
  ASSERT_TRUE(report.status.ok()) << report.status;
  EXPECT_TRUE(report.committed);
  std::vector<uint32_t> bits;
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& pushed = report.targets[i];
    ASSERT_TRUE(pushed.version.ok()) << pushed.version.status();
    EXPECT_EQ(pushed.version->version(), 2);
    EXPECT_EQ(pushed.version->state(), ModelVersionStatus::READY);
    EXPECT_EQ(pushed.version->weights_sha256(),
              client::LmHeadUploadDigest(next));
    EXPECT_GT(pushed.version->ready_unix_micros(), 0);
    EXPECT_EQ(pushed.via_chain, i > 0);
    EXPECT_LE(pushed.commit_sent, pushed.commit_answered);
    EXPECT_EQ(Latest(*fleet[i]), 2);
    auto scored = Score(*ScoringClient(*fleet[i]), 0);
    ASSERT_TRUE(scored.ok()) << scored.status();
    EXPECT_EQ(scored->version, 2);
    if (bits.empty()) bits = scored->bits;
    EXPECT_EQ(scored->bits, bits) << targets[i];
  }
}

TEST_F(TwoPhasePublishTest, StagedVersionIsNotServedUntilCommitted) {
  auto server = Start();
  ASSERT_TRUE(server != nullptr);
  LmHeadUpload next = Step(base_, 2);
  ModelRepositoryClient::UploadOptions stage;
  stage.version = 5;
  stage.stage = true;
  auto staged = Repo(*server)->Upload(next, stage);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->state(), ModelVersionStatus::STAGED);
  EXPECT_EQ(staged->ready_unix_micros(), 0);
  EXPECT_EQ(Versions(*server).at(5).state(), ModelVersionStatus::STAGED);
  EXPECT_EQ(Latest(*server), 1);
  auto client = ScoringClient(*server);
  auto pinned = Score(*client, 5);
  EXPECT_EQ(pinned.status().code(), absl::StatusCode::kNotFound);
  auto unpinned = Score(*client, 0);
  ASSERT_TRUE(unpinned.ok());
  EXPECT_EQ(unpinned->version, 1);
  // Its number is taken: another upload may not publish as 5.
  LmHeadUpload other = Step(base_, 3);
  other.version = 5;
  EXPECT_EQ(Repo(*server)->UploadModel(other).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A commit naming other weights is refused; the right one publishes.
  auto wrong = Repo(*server)->CommitVersion("policy", 5,
                                            client::LmHeadUploadDigest(other));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  auto committed = Repo(*server)->CommitVersion(
      "policy", 5, client::LmHeadUploadDigest(next));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->state(), ModelVersionStatus::READY);
  EXPECT_EQ(Latest(*server), 5);
  // A repeated commit answers the same version.
  auto again = Repo(*server)->CommitVersion("policy", 5, "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->weights_sha256(), committed->weights_sha256());
  EXPECT_EQ(Repo(*server)->AbortVersion("policy", 5).code(),
            absl::StatusCode::kFailedPrecondition);
  // A staged upload must name its number.
  stage.version = 0;
  next.version = 0;
  auto unnumbered = Repo(*server)->Upload(next, stage);
  EXPECT_EQ(unnumbered.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v1::DetailsOf(unnumbered.status()).fields,
            std::vector<std::string>{"header.model_version"});
}

TEST_F(TwoPhasePublishTest, StagedVersionNotCommittedInTimeIsDropped) {
  // Room for two versions: the ready one and one staged.
  auto server = Start(
      {"--staged_version_timeout_s=1", "--max_model_memory_bytes=1300000"});
  ASSERT_TRUE(server != nullptr);
  ModelRepositoryClient::UploadOptions stage;
  stage.version = 2;
  stage.stage = true;
  ASSERT_OK(Repo(*server)->Upload(Step(base_, 2), stage).status());
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (Versions(*server).count(2) > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));  // polling, not synchronizing
  }
  EXPECT_EQ(Versions(*server).count(2), 0u);
  EXPECT_EQ(Repo(*server)->CommitVersion("policy", 2, "").status().code(),
            absl::StatusCode::kNotFound);
  // Its memory was freed: another staged version fits again.
  stage.version = 3;
  EXPECT_TRUE(Repo(*server)->Upload(Step(base_, 3), stage).ok());
}

// 20 pushes (deltas, chain, two-phase) while callers score without a pin
// and pinned to the version they last saw: every answer of a version has
// that version's bits, and every replica ends with the same numbers and
// digests.
TEST_F(TwoPhasePublishTest, TwentyPushesUnderLoadKeepEveryReplicaAlike) {
  std::vector<std::unique_ptr<ServerProcess>> fleet;
  std::vector<std::string> targets;
  for (int i = 0; i < 3; ++i) {
    fleet.push_back(Start());
    ASSERT_TRUE(fleet.back() != nullptr);
    targets.push_back(fleet.back()->target());
  }
  std::mutex mu;
  std::map<int64_t, std::vector<uint32_t>> bits_of;  // version -> bits
  int64_t wrong_bits = 0, failed_calls = 0, calls = 0;
  std::atomic<bool> stop{false};
  std::vector<std::thread> callers;
  for (int c = 0; c < 6; ++c) {
    callers.emplace_back([&, c] {
      auto client = ScoringClient(*fleet[c % fleet.size()]);
      int64_t seen = 0;
      while (!stop.load()) {
        const bool pinned = c % 2 == 1 && seen > 0;
        auto scored = Score(*client, pinned ? seen : 0);
        std::lock_guard<std::mutex> lock(mu);
        ++calls;
        if (!scored.ok()) {
          // A pinned version may retire (4 kept) between two calls.
          const bool retired =
              pinned && scored.status().code() == absl::StatusCode::kNotFound;
          failed_calls += !retired;
          if (retired) seen = 0;
          continue;
        }
        seen = scored->version;
        auto [it, first] = bits_of.emplace(scored->version, scored->bits);
        wrong_bits += !first && it->second != scored->bits;
      }
    });
  }
  LmHeadUpload previous = base_;
  int64_t previous_version = 1;
  for (int push_index = 0; push_index < 20; ++push_index) {
    LmHeadUpload next = Step(previous, 100 + push_index);
    auto delta = client::EncodeLmHeadDelta(next, previous, previous_version);
    ASSERT_TRUE(delta.ok()) << delta.status();
    PushOptions push;
    push.fanout = PushOptions::Fanout::kChain;
    push.delta = &*delta;
    const PushReport report =
        client::PushToTargets(targets, LogpClient::Options(), {}, next, push);
    ASSERT_TRUE(report.status.ok()) << report.status;
    previous_version = report.targets[0].version->version();
    previous = std::move(next);
  }
  stop = true;
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(previous_version, 21);
  EXPECT_EQ(wrong_bits, 0);
  EXPECT_EQ(failed_calls, 0);
  EXPECT_GT(calls, 20);
  const auto reference = Versions(*fleet[0]);
  EXPECT_EQ(reference.rbegin()->first, 21);
  for (const auto& server : fleet) {
    const auto versions = Versions(*server);
    ASSERT_EQ(versions.size(), reference.size()) << server->target();
    for (const auto& [number, status] : versions) {
      ASSERT_EQ(reference.count(number), 1u) << number;
      EXPECT_EQ(status.weights_sha256(), reference.at(number).weights_sha256());
      EXPECT_EQ(status.state(), ModelVersionStatus::READY);
    }
  }
}

TEST_F(TwoPhasePublishTest, ReplicaPullsTheCurrentVersionBeforeItIsReady) {
  auto a = Start();
  auto b = Start();
  ASSERT_TRUE(a != nullptr && b != nullptr);
  const LmHeadUpload next = Step(base_, 2);
  const PushReport report = client::PushToTargets(
      {a->target(), b->target()}, LogpClient::Options(), {}, next);
  ASSERT_TRUE(report.status.ok()) << report.status;
  // The list names an address nobody listens on, and a peer behind.
  auto behind = Start();
  ASSERT_TRUE(behind != nullptr);
  auto joined = Start({"--pull_from=127.0.0.1:1," + behind->target() + "," +
                       a->target() + "," + b->target()});
  ASSERT_TRUE(joined != nullptr);
  // Start returns once the server reported ready (its port file is written
  // after health says SERVING): the version is there already.
  EXPECT_EQ(Latest(*joined), 2);
  const auto versions = Versions(*joined);
  ASSERT_EQ(versions.count(2), 1u);
  EXPECT_EQ(versions.at(2).weights_sha256(), client::LmHeadUploadDigest(next));
  EXPECT_EQ(versions.at(2).source(), "pull");
  EXPECT_EQ(BytesReceived(*joined, "peer"),
            static_cast<double>(next.payload_bytes()));
  auto from_joined = Score(*ScoringClient(*joined), 2);
  auto from_a = Score(*ScoringClient(*a), 2);
  ASSERT_TRUE(from_joined.ok() && from_a.ok());
  EXPECT_EQ(from_joined->bits, from_a->bits);
  // With no peer ahead (or none reachable) a replica starts as it is.
  auto alone = Start({"--pull_from=127.0.0.1:1"});
  ASSERT_TRUE(alone != nullptr);
  EXPECT_EQ(Latest(*alone), 1);
}

TEST_F(TwoPhasePublishTest, PullPresentsTheAdminTokenAndDownloadsNeedOne) {
  const std::string tokens = dir_ + "/admin.txt";
  {
    std::ofstream out(tokens);
    out << "# operators\nadmin-token\n";
  }
  auto a = Start({"--admin_tokens_file=" + tokens});
  ASSERT_TRUE(a != nullptr);
  LogpClient::Options connection;
  connection.target = a->target();
  ModelRepositoryClient::Options admin;
  admin.admin_token = "admin-token";
  auto repo = *ModelRepositoryClient::Create(connection, admin);
  const LmHeadUpload next = Step(base_, 2);
  ASSERT_TRUE(repo->UploadModel(next).ok());

  // Without the token, a download is refused.
  auto stub = detlogp::v1::ModelRepositoryService::NewStub(
      grpc::CreateChannel(a->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  detlogp::v1::DownloadModelRequest request;
  request.set_model("policy");
  auto reader = stub->DownloadModel(&context, request);
  detlogp::v1::UploadModelRequest message;
  EXPECT_FALSE(reader->Read(&message));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // A replica with the same tokens file presents its first token.
  auto joined =
      Start({"--admin_tokens_file=" + tokens, "--pull_from=" + a->target()});
  ASSERT_TRUE(joined != nullptr);
  auto listed = ModelRepositoryClient::Create(
                    [&] {
                      LogpClient::Options c;
                      c.target = joined->target();
                      return c;
                    }(),
                    admin)
                    .value()
                    ->ListModels();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->models_size(), 1);
  EXPECT_EQ(listed->models(0).model_version(), 2);
  EXPECT_EQ(listed->models(0).weights_sha256(),
            client::LmHeadUploadDigest(next));
}

}  // namespace
}  // namespace detlogp
