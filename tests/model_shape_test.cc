// A new version of a model keeps its hidden size and vocabulary: the
// ModelManager refuses another shape before the backend places anything,
// whatever the backend, and the serving version stays.
#include <cstdint>
#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/models/model_manager.h"
#include "tests/fake_backend.h"

namespace detlogp::server {
namespace {

using ::testing::HasSubstr;

struct Manager {
  int placed = 0;
  std::unique_ptr<ModelManager> manager;
};

std::unique_ptr<Manager> MakeManager() {
  auto out = std::make_unique<Manager>();
  ModelManager::Options options;
  options.default_model = "default";
  options.max_versions_per_model = 4;
  options.place = [counts =
                       out.get()](std::shared_ptr<const LmHeadWeights> weights)
      -> absl::StatusOr<std::shared_ptr<const LogpModel>> {
    ++counts->placed;
    return testing::FakeBackend::MakeModel(weights->hidden_size, 0.0f);
  };
  options.estimate_bytes = [](int64_t h, int64_t v, bool) { return h * v * 2; };
  options.warm_up = [](const ServedVersion&) { return absl::OkStatus(); };
  auto manager = ModelManager::Create(options);
  EXPECT_TRUE(manager.ok()) << manager.status();
  out->manager = *std::move(manager);
  return out;
}

std::shared_ptr<const LmHeadWeights> Head(int64_t hidden, int64_t vocab,
                                          int64_t padded_vocab, int seed) {
  auto weights = std::make_shared<LmHeadWeights>();
  weights->hidden_size = hidden;
  weights->vocab_size = vocab;
  weights->padded_vocab_size = padded_vocab;
  weights->weight.assign(hidden * padded_vocab, static_cast<uint16_t>(seed));
  ComputeLmHeadDigest(weights.get());
  return weights;
}

TEST(ModelShapeTest, AnotherHiddenSizeIsRefusedBeforePlacing) {
  auto m = MakeManager();
  auto first = m->manager->AddVersion("policy", Head(256, 1000, 1024, 1), {});
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string served_sha = first->weights_sha256();
  EXPECT_EQ(m->placed, 1);

  auto wider = m->manager->AddVersion("policy", Head(264, 1000, 1024, 2), {});
  EXPECT_EQ(wider.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(wider.status().message()),
              HasSubstr("hidden_size: model 'policy' serves hidden_size=256 "
                        "(version 1) and the new version has hidden_size=264"));
  auto other_vocab =
      m->manager->AddVersion("policy", Head(256, 1001, 1024, 3), {});
  EXPECT_EQ(other_vocab.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other_vocab.status().message()),
              HasSubstr("vocab_size: model 'policy' serves vocab_size=1000"));
  EXPECT_EQ(m->placed, 1);  // refused before the backend saw them

  auto latest = m->manager->Resolve("policy", 0);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ((*latest)->version, 1);
  EXPECT_EQ((*latest)->weights_sha256, served_sha);
  EXPECT_EQ(m->manager->reserved_bytes(), 256 * 1024 * 2);

  // The same shape (padding may differ) is a new version.
  auto same = m->manager->AddVersion("policy", Head(256, 1000, 1152, 4), {});
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->version(), 2);
  EXPECT_TRUE(m->manager->CheckShape("policy", 256, 1000).ok());
  EXPECT_EQ(m->manager->CheckShape("policy", 256, 999).code(),
            absl::StatusCode::kFailedPrecondition);
  // Another model is not bound by this one's shape.
  EXPECT_TRUE(m->manager->CheckShape("reference", 264, 7).ok());
}

TEST(ModelShapeTest, UnloadedModelTakesANewShape) {
  auto m = MakeManager();
  ASSERT_TRUE(
      m->manager->AddVersion("policy", Head(256, 1000, 1000, 1), {}).ok());
  ASSERT_TRUE(m->manager->Unload("policy", 1).ok());
  auto reshaped = m->manager->AddVersion("policy", Head(264, 500, 512, 2), {});
  ASSERT_TRUE(reshaped.ok()) << reshaped.status();
  EXPECT_EQ(reshaped->version(), 2);
  EXPECT_EQ(reshaped->hidden_size(), 264);
}

}  // namespace
}  // namespace detlogp::server
