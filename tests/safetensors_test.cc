#include "formats/safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <cstdio>
#include <cstring>
#include <fstream>

#include "server/models/lm_head_weights.h"
#include "server/models/projection_weights.h"

namespace detlogp::server {
namespace {

using formats::ParseSafetensorsHeader;
using formats::SafetensorsFile;
using formats::WriteSafetensors;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

std::vector<uint8_t> FloatBytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

TEST(SafetensorsTest, RoundTripsTensors) {
  const std::string path = TempPath("round_trip.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, {{"a", "F32", {2, 2}, FloatBytes({1, 2, 3, 4})},
                              {"b", "F32", {3}, FloatBytes({5, 6, 7})}})
          .ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->tensors().size(), 2u);
  EXPECT_EQ(file->tensors().at("a").shape, (std::vector<int64_t>{2, 2}));
  auto b = file->ReadTensor("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, FloatBytes({5, 6, 7}));
  EXPECT_EQ(file->ReadTensor("missing").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, ParsesMetadataAndRejectsMalformedHeaders) {
  EXPECT_TRUE(
      ParseSafetensorsHeader(
          R"({"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}})")
          .ok());
  for (
      const char* bad :
      {"", "{", "[]", R"({"w":{"dtype":"F32","shape":[2]}})",
       R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
       R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})",
       R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} trailing)",
       R"({"w":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}})"}) {
    EXPECT_FALSE(ParseSafetensorsHeader(bad).ok()) << bad;
  }
}

TEST(SafetensorsTest, RejectsTruncatedFiles) {
  const std::string path = TempPath("truncated.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, {{"a", "F32", {4}, FloatBytes({1, 2, 3, 4})}})
          .ok());
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << bytes.substr(0, bytes.size() - 4);
  EXPECT_FALSE(SafetensorsFile::Open(path).ok());
}

TEST(LmHeadWeightsTest, LoadsFloatWeightsAsBf16WithPaddingAndBias) {
  const std::string path = TempPath("lm_head.safetensors");
  std::vector<float> weight(4 * 2);
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = 0.1f * (i + 1);
  ASSERT_TRUE(
      WriteSafetensors(path,
                       {{"lm_head.weight", "F32", {4, 2}, FloatBytes(weight)},
                        {"lm_head.bias", "F32", {4}, FloatBytes({1, 2, 3, 4})}})
          .ok());
  LmHeadSource source;
  source.path = path;
  source.bias_tensor = "lm_head.bias";
  source.vocab_size = 3;
  auto head = LoadLmHead(source);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->hidden_size, 2);
  EXPECT_EQ(head->vocab_size, 3);
  EXPECT_EQ(head->padded_vocab_size, 4);
  EXPECT_EQ(head->bias.size(), 4u);
  EXPECT_EQ(head->weight[0], 0x3dcd);  // bf16(0.1f), round-to-nearest-even
  EXPECT_EQ(head->sha256.size(), 64u);

  source.vocab_size = 5;
  EXPECT_EQ(LoadLmHead(source).status().code(),
            absl::StatusCode::kInvalidArgument);
  source.vocab_size = 0;
  source.weight_tensor = "nope";
  EXPECT_EQ(LoadLmHead(source).status().code(), absl::StatusCode::kNotFound);
}

TEST(LmHeadWeightsTest, SyntheticModelIsReproducible) {
  SyntheticLmHeadOptions options;
  options.hidden_size = 64;
  options.vocab_size = 100;
  const LmHeadWeights a = SyntheticLmHead(options);
  const LmHeadWeights b = SyntheticLmHead(options);
  EXPECT_EQ(a.sha256, b.sha256);
  EXPECT_EQ(a.weight, b.weight);
  options.seed += 1;
  EXPECT_NE(SyntheticLmHead(options).sha256, a.sha256);
}

TEST(ProjectionWeightsTest, LoadsNamedTensorsAndRejectsBadShapes) {
  const std::string path = TempPath("projection.safetensors");
  std::vector<float> weight(5376 * 96), bias(5376);
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = 0.001f * (i % 997);
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = 0.5f - 0.0001f * i;
  ASSERT_TRUE(WriteSafetensors(
                  path, {{"video.w", "F32", {5376, 96}, FloatBytes(weight)},
                         {"video.b", "F32", {5376}, FloatBytes(bias)},
                         {"wrong", "F32", {96, 5376}, FloatBytes(weight)}})
                  .ok());
  ProjectionSource source;
  source.path = path;
  source.weight_tensor = "video.w";
  source.bias_tensor = "video.b";
  auto loaded = LoadProjectionWeights(source);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(std::equal(loaded->weight.begin(), loaded->weight.end(),
                         weight.begin(), weight.end()));
  EXPECT_EQ(loaded->bias, bias);
  EXPECT_EQ(loaded->sha256.size(), 64u);

  source.bias_tensor = "absent";  // an optional bias that is not there
  auto no_bias = LoadProjectionWeights(source);
  ASSERT_TRUE(no_bias.ok());
  EXPECT_TRUE(no_bias->bias.empty());
  EXPECT_NE(no_bias->sha256, loaded->sha256);

  source.weight_tensor = "wrong";  // transposed
  EXPECT_EQ(LoadProjectionWeights(source).status().code(),
            absl::StatusCode::kInvalidArgument);
  source.weight_tensor = "proj.weight";
  EXPECT_EQ(LoadProjectionWeights(source).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(SyntheticProjectionWeights().sha256,
            SyntheticProjectionWeights().sha256);
}

}  // namespace
}  // namespace detlogp::server
