#include "server/models/lm_head_weights.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/bfloat16.h"
#include "kernels/parallel_for.h"
#include "kernels/random_normal.h"
#include "formats/checkpoint.h"
#include "formats/safetensors.h"
#include "spdlog/spdlog.h"
#include "digests/sha256.h"

namespace detlogp::server {
namespace {

using formats::HeadLookup;
using formats::ResolveHead;
using formats::SafetensorDtypeSize;
using formats::SafetensorsFile;

// Converts raw tensor bytes of a float dtype to floats.
std::vector<float> BytesToFloats(const std::string& dtype,
                                 const std::vector<uint8_t>& bytes) {
  const size_t size = SafetensorDtypeSize(dtype);
  std::vector<float> out(bytes.size() / size);
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == "F32") {
      std::memcpy(&out[i], &bytes[4 * i], 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, &bytes[2 * i], 2);
      out[i] = dtype == "BF16" ? kernels::Bf16ToFloat(bits)
                               : kernels::Fp16ToFloat(bits);
    }
  }
  return out;
}

}  // namespace

kernels::LmHeadView LmHeadWeights::view() const {
  kernels::LmHeadView view;
  view.hidden_size = hidden_size;
  view.vocab_size = vocab_size;
  view.padded_vocab_size = padded_vocab_size;
  view.weight = weight.data();
  view.bias = bias.empty() ? nullptr : bias.data();
  return view;
}

void ComputeLmHeadDigest(LmHeadWeights* weights) {
  weights->sha256 = digests::ComputeLmHeadDigest(
      weights->shape(), weights->weight.data(), weights->bias.data());
}

absl::StatusOr<LmHeadWeights> LoadLmHead(const LmHeadSource& source) {
  HeadLookup lookup;
  lookup.path = source.path;
  lookup.weight_tensor = source.weight_tensor;
  lookup.bias_tensor = source.bias_tensor;
  lookup.confine_to = source.confine_to;
  auto head = ResolveHead(lookup);
  if (!head.ok()) return head.status();
  LmHeadWeights weights;
  weights.padded_vocab_size = head->padded_vocab_size;
  weights.hidden_size = head->hidden_size;
  weights.vocab_size =
      source.vocab_size > 0 ? source.vocab_size : weights.padded_vocab_size;
  if (source.vocab_size < 0 || weights.vocab_size > weights.padded_vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab_size: ", source.vocab_size, " is not in [0, ",
        weights.padded_vocab_size, "], the rows of ", head->weight_tensor));
  }
  auto file = SafetensorsFile::Open(head->weight_file);
  if (!file.ok()) return file.status();
  if (head->weight_dtype == "BF16") {  // straight into place
    weights.weight.resize(weights.padded_vocab_size * weights.hidden_size);
    if (absl::Status s =
            file->ReadTensorInto(head->weight_tensor, weights.weight.data(),
                                 weights.weight.size() * 2);
        !s.ok()) {
      return s;
    }
  } else {
    auto bytes = file->ReadTensor(head->weight_tensor);
    if (!bytes.ok()) return bytes.status();
    const std::vector<float> values = BytesToFloats(head->weight_dtype, *bytes);
    weights.weight.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      weights.weight[i] = kernels::FloatToBf16(values[i]);
    }
  }
  if (!head->bias_tensor.empty()) {
    auto bias_file = head->bias_file == head->weight_file
                         ? file
                         : SafetensorsFile::Open(head->bias_file);
    if (!bias_file.ok()) return bias_file.status();
    auto bias_bytes = bias_file->ReadTensor(head->bias_tensor);
    if (!bias_bytes.ok()) return bias_bytes.status();
    weights.bias = BytesToFloats(
        bias_file->tensors().at(head->bias_tensor).dtype, *bias_bytes);
  }
  weights.description = head->description;
  spdlog::info("lm_head: {}", head->description);
  ComputeLmHeadDigest(&weights);
  return weights;
}

LmHeadWeights SyntheticLmHead(const SyntheticLmHeadOptions& options) {
  LmHeadWeights weights;
  weights.hidden_size = options.hidden_size;
  weights.vocab_size = options.vocab_size;
  weights.padded_vocab_size = options.vocab_size;
  weights.weight.resize(options.vocab_size * options.hidden_size);
  // Each block of rows has its own stream (seeded from the block index), so
  // threads fill blocks in any order and the weights stay the same.
  constexpr int64_t kRowsPerBlock = 1024;
  const int64_t blocks =
      (options.vocab_size + kRowsPerBlock - 1) / kRowsPerBlock;
  kernels::ParallelForRanges(blocks, 0, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      kernels::RandomNormal random(options.seed * 1000003 + block);
      const int64_t begin = block * kRowsPerBlock * options.hidden_size;
      const int64_t end =
          std::min<int64_t>((block + 1) * kRowsPerBlock * options.hidden_size,
                            weights.weight.size());
      for (int64_t i = begin; i < end; ++i) {
        weights.weight[i] = kernels::FloatToBf16(random.Next(0.02f));
      }
    }
  });
  if (options.with_bias) {
    kernels::RandomNormal random(options.seed);
    weights.bias.resize(options.vocab_size);
    for (float& b : weights.bias) b = random.Next(0.1f);
  }
  weights.description = absl::StrCat("embedded synthetic model (seed ",
                                     options.seed, ", H=", options.hidden_size,
                                     ", V=", options.vocab_size, ")");
  ComputeLmHeadDigest(&weights);
  return weights;
}

}  // namespace detlogp::server
