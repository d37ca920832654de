// The weights' identity (ModelInfo.weights_sha256, and through it the
// determinism key), cut into blocks so it can be computed in parallel and
// while an upload arrives:
//
//   leaf_i  = SHA-256(block i)   blocks of 16 MiB: the weight's bytes (bf16,
//                                row-major) cut from its start, then the
//                                bias's bytes (fp32) cut from its start
//   digest  = SHA-256(preamble || leaf_0 || leaf_1 || ...)   (raw 32-byte
//   leaves) preamble = "detlogp-lm-head-v2 H=<H> V=<V> V_pad=<V_pad> bias=<0|1>
//               block=16777216\n"
//
// A single SHA-256 pass over 1.2 GB takes ~0.7 s on one core; the leaves of
// this one take ~0.05 s on 16. Clients that upload weights compute the same
// (client/python/detlogp/weights.py, client/model_repository_client.cc).
#ifndef DETLOGP_DIGESTS_LM_HEAD_DIGEST_H_
#define DETLOGP_DIGESTS_LM_HEAD_DIGEST_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace detlogp::digests {

inline constexpr int64_t kLmHeadDigestBlockBytes = int64_t{16} << 20;

struct LmHeadShape {
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t padded_vocab_size = 0;
  bool has_bias = false;

  int64_t weight_bytes() const { return padded_vocab_size * hidden_size * 2; }
  int64_t bias_bytes() const { return has_bias ? padded_vocab_size * 4 : 0; }
};

std::string LmHeadDigestPreamble(const LmHeadShape& shape);

// The leaves of one lm_head, filled in any order from any threads (each
// block by one thread), then finished.
class LmHeadDigest {
 public:
  // A block: bytes [offset, offset + size) of the weight (segment 0) or of
  // the bias (segment 1).
  struct Block {
    int segment = 0;
    int64_t offset = 0;
    int64_t size = 0;
  };

  explicit LmHeadDigest(const LmHeadShape& shape);

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  const Block& block(int64_t index) const { return blocks_[index]; }
  // The block that holds byte `offset` of the stream weight || bias.
  int64_t BlockAt(int64_t stream_offset) const;

  // Hashes block `index` from its `block(index).size` bytes.
  void HashBlock(int64_t index, const void* data);
  // Hex SHA-256 of the preamble and every leaf; every block must be hashed.
  std::string Finish() const;

 private:
  LmHeadShape shape_;
  std::vector<Block> blocks_;
  std::vector<std::array<unsigned char, 32>> leaves_;
};

// The digest of complete buffers (bias may be null when the shape has
// none), its blocks hashed on up to `threads` threads (0: all cores).
std::string ComputeLmHeadDigest(const LmHeadShape& shape, const void* weight,
                                const void* bias, int threads = 0);

}  // namespace detlogp::digests

#endif  // DETLOGP_DIGESTS_LM_HEAD_DIGEST_H_
