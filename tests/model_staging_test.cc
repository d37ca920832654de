// Two-phase publish in the ModelManager: a staged version is placed and
// numbered but not servable until committed; an abort or the staged timeout
// drops it (its memory freed, its number given back when still the newest),
// and a commit makes it the latest in one step. Time is a manual clock.
#include <cstdint>
#include <memory>

#include "gtest/gtest.h"
#include "proto/status_details.h"
#include "server/models/model_manager.h"
#include "tests/fake_backend.h"

namespace detlogp::server {
namespace {

using detlogp::v1::ModelVersionStatus;

struct Fixture {
  absl::Time now = absl::FromUnixSeconds(1'000'000);
  std::unique_ptr<ModelManager> manager;
};

std::unique_ptr<Fixture> MakeManager(int64_t max_memory_bytes = 0) {
  auto out = std::make_unique<Fixture>();
  ModelManager::Options options;
  options.default_model = "policy";
  options.max_versions_per_model = 2;
  options.max_model_memory_bytes = max_memory_bytes;
  options.staged_timeout = absl::Seconds(60);
  // The sweep thread never runs within a test: the test sweeps.
  options.staged_sweep_interval = absl::Hours(1);
  options.now = [clock = out.get()] { return clock->now; };
  options.place = [](std::shared_ptr<const LmHeadWeights> weights)
      -> absl::StatusOr<std::shared_ptr<const LogpModel>> {
    return testing::FakeBackend::MakeModel(weights->hidden_size, 0.0f);
  };
  options.estimate_bytes = [](int64_t h, int64_t v, bool) { return h * v * 2; };
  options.warm_up = [](const ServedVersion&) { return absl::OkStatus(); };
  auto manager = ModelManager::Create(options);
  EXPECT_TRUE(manager.ok()) << manager.status();
  out->manager = *std::move(manager);
  return out;
}

std::shared_ptr<const LmHeadWeights> Head(int seed) {
  auto weights = std::make_shared<LmHeadWeights>();
  weights->hidden_size = 64;
  weights->vocab_size = 100;
  weights->padded_vocab_size = 128;
  weights->weight.assign(64 * 128, static_cast<uint16_t>(seed));
  ComputeLmHeadDigest(weights.get());
  return weights;
}

VersionOrigin Numbered(int64_t version) {
  VersionOrigin origin;
  origin.description = "test";
  origin.version = version;
  return origin;
}

absl::StatusOr<ModelVersionStatus> Stage(ModelManager& manager, int seed,
                                         int64_t version) {
  return manager.StageVersion("policy", Head(seed), Numbered(version), {});
}

TEST(ModelStagingTest, StagedVersionIsNotServedUntilCommitted) {
  auto f = MakeManager();
  ASSERT_TRUE(f->manager->AddVersion("policy", Head(1), {}).ok());
  auto staged = Stage(*f->manager, 2, 2);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->state(), ModelVersionStatus::STAGED);
  EXPECT_EQ(staged->ready_unix_micros(), 0);
  EXPECT_EQ((*f->manager->Resolve("policy", 0))->version, 1);
  auto pinned = f->manager->Resolve("policy", 2);
  EXPECT_EQ(pinned.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(v1::DetailsOf(pinned.status()).reason,
            v1::kReasonVersionUnavailable);
  auto info = f->manager->Describe("policy", 0);
  ASSERT_TRUE(info.ok());
  ASSERT_EQ(info->versions_size(), 2);
  EXPECT_EQ(info->versions(1).state(), ModelVersionStatus::STAGED);

  auto committed =
      f->manager->CommitVersion("policy", 2, staged->weights_sha256());
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->state(), ModelVersionStatus::READY);
  EXPECT_GT(committed->ready_unix_micros(), 0);
  EXPECT_EQ((*f->manager->Resolve("policy", 0))->version, 2);
  EXPECT_EQ((*f->manager->Resolve("policy", 2))->weights_sha256,
            staged->weights_sha256());
  // Repeated: the same answer; an abort now is refused.
  auto again = f->manager->CommitVersion("policy", 2, "");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->version(), 2);
  EXPECT_EQ(f->manager->AbortVersion("policy", 2).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ModelStagingTest, CommitNamingOtherWeightsIsRefusedAndKeepsTheStage) {
  auto f = MakeManager();
  ASSERT_TRUE(f->manager->AddVersion("policy", Head(1), {}).ok());
  ASSERT_TRUE(Stage(*f->manager, 2, 2).ok());
  auto wrong = f->manager->CommitVersion("policy", 2, Head(3)->sha256);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(v1::DetailsOf(wrong.status()).reason, v1::kReasonWeightsMismatch);
  EXPECT_EQ((*f->manager->Resolve("policy", 0))->version, 1);
  EXPECT_TRUE(f->manager->CommitVersion("policy", 2, Head(2)->sha256).ok());
}

TEST(ModelStagingTest, AbortDropsTheVersionFreesItsMemoryAndItsNumber) {
  // Room for two versions of [128, 64] bf16 (16384 bytes each).
  auto f = MakeManager(/*max_memory_bytes=*/40000);
  ASSERT_TRUE(f->manager->AddVersion("policy", Head(1), {}).ok());
  ASSERT_TRUE(Stage(*f->manager, 2, 2).ok());
  EXPECT_EQ(f->manager->reserved_bytes(), 2 * 16384);
  EXPECT_EQ(f->manager->NextVersion("policy"), 3);
  // A third does not fit while the stage holds its memory.
  EXPECT_EQ(Stage(*f->manager, 3, 3).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(f->manager->AbortVersion("policy", 2).ok());
  EXPECT_EQ(f->manager->reserved_bytes(), 16384);
  EXPECT_EQ(f->manager->NextVersion("policy"), 2);
  EXPECT_EQ(f->manager->CommitVersion("policy", 2, "").status().code(),
            absl::StatusCode::kNotFound);
  // Aborting what is not staged changes nothing.
  EXPECT_TRUE(f->manager->AbortVersion("policy", 2).ok());
  EXPECT_TRUE(f->manager->AbortVersion("policy", 9).ok());
  EXPECT_EQ((*f->manager->Resolve("policy", 0))->version, 1);
}

TEST(ModelStagingTest, StagedVersionIsDroppedOnceItsTimeoutPasses) {
  auto f = MakeManager();
  ASSERT_TRUE(f->manager->AddVersion("policy", Head(1), {}).ok());
  ASSERT_TRUE(Stage(*f->manager, 2, 2).ok());
  f->now += absl::Seconds(30);
  ASSERT_TRUE(Stage(*f->manager, 3, 3).ok());
  f->now += absl::Seconds(29);
  EXPECT_EQ(f->manager->DropExpiredStaged(f->now), 0);
  f->now += absl::Seconds(1);  // version 2 is 60 s old, version 3 30 s
  EXPECT_EQ(f->manager->DropExpiredStaged(f->now), 1);
  EXPECT_EQ(f->manager->CommitVersion("policy", 2, "").status().code(),
            absl::StatusCode::kNotFound);
  // Version 3 was taken after 2: 2's number is not given back.
  EXPECT_EQ(f->manager->NextVersion("policy"), 4);
  ASSERT_TRUE(f->manager->CommitVersion("policy", 3, "").ok());
  EXPECT_EQ((*f->manager->Resolve("policy", 0))->version, 3);
  EXPECT_EQ(f->manager->reserved_bytes(), 2 * 16384);
}

TEST(ModelStagingTest, StagedVersionNamesItsNumber) {
  auto f = MakeManager();
  auto unnumbered = Stage(*f->manager, 1, 0);
  EXPECT_EQ(unnumbered.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v1::DetailsOf(unnumbered.status()).fields,
            std::vector<std::string>{"model_version"});
}

}  // namespace
}  // namespace detlogp::server
