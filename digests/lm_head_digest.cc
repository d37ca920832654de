#include "digests/lm_head_digest.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/parallel_for.h"
#include "digests/sha256.h"

namespace detlogp::digests {

std::string LmHeadDigestPreamble(const LmHeadShape& shape) {
  return absl::StrCat(
      "detlogp-lm-head-v2 H=", shape.hidden_size, " V=", shape.vocab_size,
      " V_pad=", shape.padded_vocab_size, " bias=", shape.has_bias ? 1 : 0,
      " block=", kLmHeadDigestBlockBytes, "\n");
}

LmHeadDigest::LmHeadDigest(const LmHeadShape& shape) : shape_(shape) {
  for (int segment = 0; segment < 2; ++segment) {
    const int64_t bytes =
        segment == 0 ? shape.weight_bytes() : shape.bias_bytes();
    for (int64_t offset = 0; offset < bytes;
         offset += kLmHeadDigestBlockBytes) {
      blocks_.push_back(
          {segment, offset, std::min(kLmHeadDigestBlockBytes, bytes - offset)});
    }
  }
  leaves_.resize(blocks_.size());
}

int64_t LmHeadDigest::BlockAt(int64_t stream_offset) const {
  const int64_t weight_bytes = shape_.weight_bytes();
  const int64_t weight_blocks =
      (weight_bytes + kLmHeadDigestBlockBytes - 1) / kLmHeadDigestBlockBytes;
  return stream_offset < weight_bytes
             ? stream_offset / kLmHeadDigestBlockBytes
             : weight_blocks +
                   (stream_offset - weight_bytes) / kLmHeadDigestBlockBytes;
}

void LmHeadDigest::HashBlock(int64_t index, const void* data) {
  Sha256 hash;
  hash.Update(data, blocks_[index].size);
  const std::string leaf = hash.Digest();
  std::memcpy(leaves_[index].data(), leaf.data(), leaves_[index].size());
}

std::string LmHeadDigest::Finish() const {
  Sha256 hash;
  hash.Update(LmHeadDigestPreamble(shape_));
  for (const auto& leaf : leaves_) hash.Update(leaf.data(), leaf.size());
  return hash.HexDigest();
}

std::string ComputeLmHeadDigest(const LmHeadShape& shape, const void* weight,
                                const void* bias, int threads) {
  LmHeadDigest digest(shape);
  kernels::ParallelForRanges(
      digest.num_blocks(), threads, [&](int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i) {
          const LmHeadDigest::Block& block = digest.block(i);
          const char* base =
              static_cast<const char*>(block.segment == 0 ? weight : bias);
          digest.HashBlock(i, base + block.offset);
        }
      });
  return digest.Finish();
}

}  // namespace detlogp::digests
