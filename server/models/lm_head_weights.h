// The lm_head held by the server: bf16 weight rows, optional fp32 bias, and
// the digest that the determinism key is built on.
#ifndef DETLOGP_SERVER_MODELS_LM_HEAD_WEIGHTS_H_
#define DETLOGP_SERVER_MODELS_LM_HEAD_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/lm_head.h"
#include "digests/lm_head_digest.h"

namespace detlogp::server {

// Leaves elements uninitialised on resize: a 1.2 GB weight about to be
// overwritten is not zero-filled first (that fill, and its page faults on
// one thread, took ~0.3 s), and the threads that fill it fault its pages in
// parallel.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  using std::allocator<T>::allocator;
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using Bf16Values = std::vector<uint16_t, DefaultInitAllocator<uint16_t>>;

struct LmHeadWeights {
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;         // real vocabulary
  int64_t padded_vocab_size = 0;  // rows of `weight`
  Bf16Values weight;              // bf16 bits, [padded_vocab_size, hidden_size]
  std::vector<float> bias;        // [padded_vocab_size], or empty
  std::string sha256;             // hex digest of shape, weight and bias
  std::string description;        // where the weights came from, for logs

  kernels::LmHeadView view() const;
  digests::LmHeadShape shape() const {
    return {hidden_size, vocab_size, padded_vocab_size, !bias.empty()};
  }
};

struct LmHeadSource {
  // A Hugging Face checkpoint directory or a .safetensors file
  // (checkpoint.h says how the head is found in either).
  std::string path;
  // The [V_pad, H] weight; empty: lm_head.weight, else the tied input
  // embedding.
  std::string weight_tensor;
  // The [V_pad] bias; empty: lm_head.bias when the head is lm_head.weight
  // and the checkpoint has one.
  std::string bias_tensor;
  int64_t vocab_size = 0;  // real vocabulary; 0 means every weight row
  // When set, every file read must lie inside this directory (--model_root).
  std::string confine_to;
};

// Finds the head (ResolveHead), reads only its bytes and converts them (F32 /
// F16 weights are rounded to bf16, RNE); logs which tensor of which file.
absl::StatusOr<LmHeadWeights> LoadLmHead(const LmHeadSource& source);

// The embedded default: weights ~ N(0, 0.02^2), bias ~ N(0, 0.1^2), from a
// fixed seed, so every build serves the same synthetic model.
struct SyntheticLmHeadOptions {
  int64_t hidden_size = 1024;
  int64_t vocab_size = 32000;
  uint64_t seed = 20261129;
  bool with_bias = true;
};
LmHeadWeights SyntheticLmHead(const SyntheticLmHeadOptions& options);

// Fills the digest from the shape, weight and bias (lm_head_digest.h).
void ComputeLmHeadDigest(LmHeadWeights* weights);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_MODELS_LM_HEAD_WEIGHTS_H_
