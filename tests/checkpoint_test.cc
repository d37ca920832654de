// The lm_head resolver (formats/checkpoint.h) on checkpoint
// directories written the way save_pretrained writes them, and LoadLmHead's
// bits against the same head given as a bare file.
#include "formats/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bfloat16.h"
#include "server/models/lm_head_weights.h"
#include "formats/safetensors.h"

namespace detlogp::server {
namespace {

using formats::HeadLookup;
using formats::ResolveHead;
using formats::SafetensorDtypeSize;
using formats::SafetensorToWrite;
using formats::WriteSafetensors;

using ::testing::HasSubstr;

constexpr int64_t kHidden = 16;
constexpr int64_t kVocab = 40;

// A fresh directory under the test's temporary directory.
std::string MakeDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(root != nullptr ? root : "/tmp", "/", name);
  std::string command = absl::StrCat("rm -rf '", dir, "'");
  EXPECT_EQ(std::system(command.c_str()), 0);
  EXPECT_EQ(mkdir(dir.c_str(), 0755), 0) << dir;
  return dir;
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// A float tensor of `rows` x `cols` (cols 0: a vector) with values from
// `seed`, in `dtype` (BF16, F16 or F32).
SafetensorToWrite FloatTensor(const std::string& name, int64_t rows,
                              int64_t cols, int seed,
                              const std::string& dtype = "BF16") {
  SafetensorToWrite t;
  t.name = name;
  t.dtype = dtype;
  t.shape =
      cols == 0 ? std::vector<int64_t>{rows} : std::vector<int64_t>{rows, cols};
  const int64_t count = rows * (cols == 0 ? 1 : cols);
  const int size = SafetensorDtypeSize(dtype);
  t.data.resize(count * size);
  for (int64_t i = 0; i < count; ++i) {
    const float value =
        static_cast<float>(((i * 7919 + seed * 104729) % 2001) - 1000) / 997.0f;
    if (dtype == "F32") {
      std::memcpy(&t.data[4 * i], &value, 4);
    } else {
      const uint16_t bits = kernels::FloatToBf16(value);
      std::memcpy(&t.data[2 * i], &bits, 2);
    }
  }
  return t;
}

// An int64 buffer as transformers saves some (model.position_ids).
SafetensorToWrite Int64Tensor(const std::string& name, int64_t count) {
  SafetensorToWrite t;
  t.name = name;
  t.dtype = "I64";
  t.shape = {1, count};
  t.data.resize(count * 8);
  for (int64_t i = 0; i < count; ++i) std::memcpy(&t.data[8 * i], &i, 8);
  return t;
}

std::string Config(bool tied, const std::string& where = "top") {
  const std::string sizes =
      absl::StrCat("\"hidden_size\": ", kHidden, ", \"vocab_size\": ", kVocab);
  const std::string tie =
      absl::StrCat("\"tie_word_embeddings\": ", tied ? "true" : "false");
  if (where == "text_config") {
    return absl::StrCat("{\"model_type\": \"llava\", \"text_config\": {", sizes,
                        ", ", tie, "}}");
  }
  if (where == "absent") return absl::StrCat("{", sizes, "}");
  return absl::StrCat("{\"model_type\": \"qwen2\", ", sizes, ", ", tie, "}");
}

// The body tensors every layout carries (the head is added per test).
std::vector<SafetensorToWrite> Body(const std::string& embedding) {
  return {FloatTensor(embedding, kVocab, kHidden, 1),
          FloatTensor("model.layers.0.mlp.up_proj.weight", 32, kHidden, 2),
          FloatTensor("model.norm.weight", kHidden, 0, 3, "F32"),
          Int64Tensor("model.position_ids", 64)};
}

// The head as a bare file, for comparing bits.
std::string BareHead(const std::string& dir, const SafetensorToWrite& weight,
                     const SafetensorToWrite* bias = nullptr) {
  SafetensorToWrite w = weight;
  w.name = "lm_head.weight";
  std::vector<SafetensorToWrite> tensors = {w};
  if (bias != nullptr) {
    SafetensorToWrite b = *bias;
    b.name = "lm_head.bias";
    tensors.push_back(b);
  }
  const std::string path = dir + "/bare_head.safetensors";
  EXPECT_TRUE(WriteSafetensors(path, tensors).ok());
  return path;
}

void ExpectSameBits(const std::string& checkpoint, const std::string& bare,
                    bool with_bias) {
  LmHeadSource from_checkpoint;
  from_checkpoint.path = checkpoint;
  auto a = LoadLmHead(from_checkpoint);
  ASSERT_TRUE(a.ok()) << a.status();
  LmHeadSource from_file;
  from_file.path = bare;
  from_file.weight_tensor = "lm_head.weight";
  from_file.bias_tensor = with_bias ? "lm_head.bias" : "";
  auto b = LoadLmHead(from_file);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->hidden_size, kHidden);
  EXPECT_EQ(a->padded_vocab_size, kVocab);
  EXPECT_TRUE(a->weight == b->weight);
  EXPECT_EQ(a->bias, b->bias);
  EXPECT_EQ(a->bias.empty(), !with_bias);
  EXPECT_EQ(a->sha256, b->sha256);
}

TEST(CheckpointTest, SingleFileUntied) {
  const std::string dir = MakeDir("single");
  auto tensors = Body("model.embed_tokens.weight");
  const SafetensorToWrite head =
      FloatTensor("lm_head.weight", kVocab, kHidden, 9);
  tensors.push_back(head);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  WriteText(dir + "/config.json", Config(false));
  auto resolved = ResolveHead({dir});
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->weight_tensor, "lm_head.weight");
  EXPECT_EQ(resolved->weight_file, dir + "/model.safetensors");
  EXPECT_EQ(resolved->weight_dtype, "BF16");
  EXPECT_FALSE(resolved->tied);
  EXPECT_TRUE(resolved->bias_tensor.empty());
  EXPECT_THAT(resolved->description,
              HasSubstr("lm_head.weight (BF16 [40, 16]) in model.safetensors"));
  ExpectSameBits(dir, BareHead(MakeDir("single_bare"), head), false);
  // The file itself, beside its config.json, is the same checkpoint.
  ExpectSameBits(dir + "/model.safetensors",
                 BareHead(MakeDir("single_bare2"), head), false);
}

// Four shards with the head in the third; the other shards are not valid
// safetensors at all, so reading any of them would fail.
TEST(CheckpointTest, ShardedReadsOnlyTheHeadsShard) {
  const std::string dir = MakeDir("sharded");
  const SafetensorToWrite head =
      FloatTensor("lm_head.weight", kVocab, kHidden, 5);
  const SafetensorToWrite bias =
      FloatTensor("lm_head.bias", kVocab, 0, 6, "F32");
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model-00003-of-00004.safetensors",
                       {head, bias, Int64Tensor("model.position_ids", 8)})
          .ok());
  for (const char* other :
       {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
        "model-00004-of-00004.safetensors"}) {
    WriteText(dir + "/" + other, "not read");
  }
  WriteText(dir + "/model.safetensors.index.json",
            R"({"metadata": {"total_size": 1234}, "weight_map": {
              "model.embed_tokens.weight": "model-00001-of-00004.safetensors",
              "model.layers.0.mlp.up_proj.weight": "model-00002-of-00004.safetensors",
              "lm_head.weight": "model-00003-of-00004.safetensors",
              "lm_head.bias": "model-00003-of-00004.safetensors",
              "model.position_ids": "model-00003-of-00004.safetensors",
              "model.norm.weight": "model-00004-of-00004.safetensors"}})");
  WriteText(dir + "/config.json", Config(false));
  auto resolved = ResolveHead({dir});
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->weight_file, dir + "/model-00003-of-00004.safetensors");
  EXPECT_EQ(resolved->bias_tensor, "lm_head.bias");
  EXPECT_THAT(resolved->description,
              HasSubstr("in model-00003-of-00004.safetensors of " + dir));
  ExpectSameBits(dir, BareHead(MakeDir("sharded_bare"), head, &bias), true);

  // The index given as if it were weights, or a shard without the head.
  auto index = ResolveHead({dir + "/model.safetensors.index.json"});
  EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(index.status().message()),
      HasSubstr("is a shard index; lm_head.weight is in "
                "model-00003-of-00004.safetensors: pass the directory " +
                dir));
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00001-of-00004.safetensors",
                               {FloatTensor("model.embed_tokens.weight", kVocab,
                                            kHidden, 1)})
                  .ok());
  auto shard = ResolveHead({dir + "/model-00001-of-00004.safetensors"});
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(shard.status().message()),
              HasSubstr("no tensor 'lm_head.weight'"));
  EXPECT_THAT(
      std::string(shard.status().message()),
      HasSubstr("; this is one shard of a checkpoint: "
                "model.safetensors.index.json puts lm_head.weight in "
                "model-00003-of-00004.safetensors; pass the directory " +
                dir));
}

TEST(CheckpointTest, TiedUsesTheInputEmbedding) {
  for (const char* where : {"top", "text_config", "absent"}) {
    SCOPED_TRACE(where);
    const std::string embedding =
        std::string(where) == "text_config"
            ? "language_model.model.embed_tokens.weight"
            : "model.embed_tokens.weight";
    const std::string dir = MakeDir(absl::StrCat("tied_", where));
    auto tensors = Body(embedding);
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", tensors).ok());
    WriteText(dir + "/config.json", Config(true, where));
    auto resolved = ResolveHead({dir});
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    EXPECT_EQ(resolved->weight_tensor, embedding);
    EXPECT_TRUE(resolved->tied);
    EXPECT_THAT(resolved->description, HasSubstr("the tied input embedding"));
    ExpectSameBits(
        dir, BareHead(MakeDir(absl::StrCat("tied_bare_", where)), tensors[0]),
        false);
  }
}

TEST(CheckpointTest, OtherFamiliesEmbeddingNames) {
  for (const char* name :
       {"transformer.wte.weight", "model.decoder.embed_tokens.weight",
        "gpt_neox.embed_in.weight"}) {
    const std::string dir = MakeDir("family");
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                                 {FloatTensor(name, kVocab, kHidden, 4, "F32")})
                    .ok());
    WriteText(dir + "/config.json", Config(true));
    auto resolved = ResolveHead({dir});
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    EXPECT_EQ(resolved->weight_tensor, name);
    EXPECT_EQ(resolved->weight_dtype, "F32");
  }
}

TEST(CheckpointTest, UntiedWithoutHeadIsRefused) {
  const std::string dir = MakeDir("untied_no_head");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               Body("model.embed_tokens.weight"))
                  .ok());
  WriteText(dir + "/config.json", Config(false));
  auto resolved = ResolveHead({dir});
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(resolved.status().message()),
              HasSubstr("no lm_head.weight and tie_word_embeddings is false"));
}

// A multimodal wrapper whose top-level flag disagrees with its text config:
// the text config's flag decides, as vLLM reads it, both ways round.
TEST(CheckpointTest, TextConfigTieFlagWinsOverTopLevel) {
  const std::string sizes =
      absl::StrCat("\"hidden_size\": ", kHidden, ", \"vocab_size\": ", kVocab);
  const auto conflicting = [&](bool top, bool text) {
    return absl::StrCat("{\"model_type\": \"llava\", \"tie_word_embeddings\": ",
                        top ? "true" : "false", ", \"text_config\": {", sizes,
                        ", \"tie_word_embeddings\": ", text ? "true" : "false",
                        "}}");
  };
  const std::string embedding = "language_model.model.embed_tokens.weight";

  const std::string tied = MakeDir("text_config_tied_top_untied");
  ASSERT_TRUE(
      WriteSafetensors(tied + "/model.safetensors", Body(embedding)).ok());
  WriteText(tied + "/config.json", conflicting(false, true));
  auto resolved = ResolveHead({tied});
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->weight_tensor, embedding);
  EXPECT_TRUE(resolved->tied);

  const std::string untied = MakeDir("text_config_untied_top_tied");
  ASSERT_TRUE(
      WriteSafetensors(untied + "/model.safetensors", Body(embedding)).ok());
  WriteText(untied + "/config.json", conflicting(true, false));
  resolved = ResolveHead({untied});
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(resolved.status().message()),
              HasSubstr("no lm_head.weight and tie_word_embeddings is false"));
}

TEST(CheckpointTest, EmptyDirectoryIsRefused) {
  const std::string dir = MakeDir("empty");
  WriteText(dir + "/config.json", Config(false));
  auto resolved = ResolveHead({dir});
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(resolved.status().message()),
              HasSubstr(dir + " is a directory with no model.safetensors or "
                              "model.safetensors.index.json"));
}

TEST(CheckpointTest, ShapeMustMatchConfig) {
  const std::string dir = MakeDir("bad_shape");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {FloatTensor("lm_head.weight", kVocab, 8, 1)})
                  .ok());
  WriteText(dir + "/config.json", Config(false));
  auto resolved = ResolveHead({dir});
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(resolved.status().message()),
              HasSubstr("lm_head.weight is [40, 8] but config.json says "
                        "hidden_size=16"));
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {FloatTensor("lm_head.weight", 48, kHidden, 1)})
                  .ok());
  resolved = ResolveHead({dir});
  EXPECT_THAT(std::string(resolved.status().message()),
              HasSubstr("config.json says vocab_size=40"));
}

TEST(CheckpointTest, NamedTensorAndBias) {
  const std::string dir = MakeDir("named");
  auto tensors = Body("model.embed_tokens.weight");
  tensors.push_back(FloatTensor("lm_head.weight", kVocab, kHidden, 9));
  tensors.push_back(FloatTensor("lm_head.bias", kVocab, 0, 10, "F32"));
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  WriteText(dir + "/config.json", Config(false));
  // Named explicitly, the embedding is served (and no bias is guessed).
  auto named = ResolveHead({dir, "model.embed_tokens.weight"});
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->weight_tensor, "model.embed_tokens.weight");
  EXPECT_TRUE(named->bias_tensor.empty());
  // lm_head.weight brings its bias along.
  auto auto_head = ResolveHead({dir});
  ASSERT_TRUE(auto_head.ok()) << auto_head.status();
  EXPECT_EQ(auto_head->bias_tensor, "lm_head.bias");
  auto missing = ResolveHead({dir, "lm_head.nope"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("no tensor 'lm_head.nope'"));
  // An int64 tensor is refused only when it is asked for as the head.
  auto int_head = ResolveHead({dir, "model.position_ids"});
  EXPECT_EQ(int_head.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(int_head.status().message()), HasSubstr("dtype I64"));
}

TEST(CheckpointTest, IndexMayNotLeaveTheCheckpoint) {
  const std::string dir = MakeDir("escape");
  WriteText(dir + "/model.safetensors.index.json",
            R"({"weight_map": {"lm_head.weight": "../x.safetensors"}})");
  auto resolved = ResolveHead({dir});
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(resolved.status().message()),
              HasSubstr("leaves the checkpoint"));
}

TEST(CheckpointTest, ConfinedFilesStayInsideTheRoot) {
  const std::string root = MakeDir("root");
  const std::string outside = MakeDir("outside");
  ASSERT_TRUE(
      WriteSafetensors(outside + "/model.safetensors",
                       {FloatTensor("lm_head.weight", kVocab, kHidden, 1)})
          .ok());
  ASSERT_EQ(mkdir((root + "/ckpt").c_str(), 0755), 0);
  ASSERT_EQ(symlink((outside + "/model.safetensors").c_str(),
                    (root + "/ckpt/model.safetensors").c_str()),
            0);
  char canonical[PATH_MAX];
  ASSERT_NE(realpath(root.c_str(), canonical), nullptr);
  HeadLookup lookup;
  lookup.path = root + "/ckpt";
  lookup.confine_to = canonical;
  auto resolved = ResolveHead(lookup);
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kPermissionDenied);
  lookup.confine_to.clear();
  EXPECT_TRUE(ResolveHead(lookup).ok());
}

}  // namespace
}  // namespace detlogp::server
