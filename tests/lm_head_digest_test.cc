// The weights' digest as docs/live_weights.md defines it, computed here the
// slow way, against the parallel one and the streaming upload assembler.
#include "digests/lm_head_digest.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "digests/sha256.h"
#include "server/models/upload_assembler.h"

namespace detlogp::server {
namespace {

using digests::ComputeLmHeadDigest;
using digests::LmHeadShape;
using digests::Sha256;

struct Head {
  LmHeadShape shape;
  std::vector<uint16_t> weight;
  std::vector<float> bias;
};

Head RandomHead(int64_t hidden, int64_t vocab, int64_t padded, bool bias,
                int seed) {
  Head head{{hidden, vocab, padded, bias},
            std::vector<uint16_t>(padded * hidden),
            std::vector<float>(bias ? padded : 0)};
  std::mt19937 random(seed);
  for (uint16_t& w : head.weight) w = static_cast<uint16_t>(random());
  for (float& b : head.bias) b = static_cast<float>(random()) / 1e9f;
  return head;
}

// Straight from the definition: leaves over 16 MiB blocks of the weight,
// then of the bias; the digest over the preamble and the raw leaves.
std::string ReferenceDigest(const Head& head) {
  std::string leaves;
  const char* parts[2] = {reinterpret_cast<const char*>(head.weight.data()),
                          reinterpret_cast<const char*>(head.bias.data())};
  const int64_t sizes[2] = {head.shape.weight_bytes(), head.shape.bias_bytes()};
  for (int part = 0; part < 2; ++part) {
    for (int64_t offset = 0; offset < sizes[part]; offset += 16 << 20) {
      Sha256 leaf;
      leaf.Update(parts[part] + offset,
                  std::min<int64_t>(16 << 20, sizes[part] - offset));
      leaves += leaf.Digest();
    }
  }
  Sha256 digest;
  digest.Update(absl::StrCat(
      "detlogp-lm-head-v2 H=", head.shape.hidden_size,
      " V=", head.shape.vocab_size, " V_pad=", head.shape.padded_vocab_size,
      " bias=", head.shape.has_bias ? 1 : 0, " block=16777216\n"));
  digest.Update(leaves);
  return digest.HexDigest();
}

TEST(LmHeadDigestTest, ParallelDigestFollowsTheDefinition) {
  // One block, several blocks with a short last one, with and without bias.
  for (const Head& head : {RandomHead(64, 1000, 1024, true, 1),
                           RandomHead(4096, 5000, 5000, true, 2),
                           RandomHead(2048, 4100, 4100, false, 3)}) {
    const std::string expected = ReferenceDigest(head);
    for (int threads : {1, 3, 0}) {
      EXPECT_EQ(ComputeLmHeadDigest(head.shape, head.weight.data(),
                                    head.bias.data(), threads),
                expected)
          << "threads " << threads;
    }
  }
}

TEST(LmHeadDigestTest, DigestNamesShapeAndEveryByte) {
  Head head = RandomHead(64, 1000, 1024, true, 4);
  const std::string base = ReferenceDigest(head);
  Head other_vocab = head;
  other_vocab.shape.vocab_size = 999;
  EXPECT_NE(ReferenceDigest(other_vocab), base);
  Head flipped = head;
  flipped.bias.back() = -flipped.bias.back();
  EXPECT_NE(ComputeLmHeadDigest(flipped.shape, flipped.weight.data(),
                                flipped.bias.data()),
            base);
}

TEST(UploadAssemblerTest, AnyChunkingGivesTheWeightsAndTheDigest) {
  const Head head =
      RandomHead(4096, 5000, 5000, true, 5);  // 2 weight blocks + bias
  std::string stream(reinterpret_cast<const char*>(head.weight.data()),
                     head.shape.weight_bytes());
  stream.append(reinterpret_cast<const char*>(head.bias.data()),
                head.shape.bias_bytes());
  for (size_t chunk :
       {size_t{1} << 22, size_t{7777777}, size_t{16} << 20, stream.size()}) {
    UploadAssembler assembler(head.shape, nullptr, 3);
    for (size_t offset = 0; offset < stream.size(); offset += chunk) {
      ASSERT_TRUE(assembler
                      .Append(stream.data() + offset,
                              std::min(chunk, stream.size() - offset))
                      .ok());
    }
    auto digest = assembler.Finish();
    ASSERT_TRUE(digest.ok()) << digest.status();
    EXPECT_EQ(*digest, ReferenceDigest(head)) << "chunk " << chunk;
    auto weights = assembler.TakeWeights();
    EXPECT_TRUE(std::equal(weights->weight.begin(), weights->weight.end(),
                           head.weight.begin(), head.weight.end()));
    EXPECT_EQ(weights->bias, head.bias);
  }
}

TEST(UploadAssemblerTest, ShortAndLongStreamsAreRefused) {
  const Head head = RandomHead(64, 1000, 1024, false, 6);
  {
    UploadAssembler assembler(head.shape, nullptr);
    ASSERT_TRUE(assembler.Append(head.weight.data(), 100).ok());
    EXPECT_EQ(assembler.Finish().status().code(),
              absl::StatusCode::kInvalidArgument);
  }  // destroying an unfinished assembler stops its threads
  UploadAssembler assembler(head.shape, nullptr);
  std::vector<char> too_many(head.shape.weight_bytes() + 1);
  EXPECT_EQ(assembler.Append(too_many.data(), too_many.size()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace detlogp::server
