#include "server/models/projection_weights.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/projection.h"
#include "kernels/random_normal.h"
#include "formats/safetensors.h"
#include "digests/sha256.h"

namespace detlogp::server {
namespace {

using formats::SafetensorInfo;
using formats::SafetensorsFile;

void ComputeDigest(ProjectionWeights* weights) {
  digests::Sha256 hash;
  hash.Update(absl::StrCat(
      "detlogp-h3-projection-v1 bias=", weights->bias.empty() ? 0 : 1, "\n"));
  hash.Update(weights->weight.data(), weights->weight.size() * sizeof(float));
  hash.Update(weights->bias.data(), weights->bias.size() * sizeof(float));
  weights->sha256 = hash.HexDigest();
}

absl::StatusOr<std::vector<float>> ReadF32(const SafetensorsFile& file,
                                           const std::string& name,
                                           const std::vector<int64_t>& shape) {
  const SafetensorInfo& info = file.tensors().at(name);
  if (info.dtype != "F32" || info.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": expected F32 of shape [", absl::StrJoin(shape, ", "), "]"));
  }
  auto bytes = file.ReadTensor(name);
  if (!bytes.ok()) return bytes.status();
  std::vector<float> values(bytes->size() / sizeof(float));
  std::memcpy(values.data(), bytes->data(), bytes->size());
  return values;
}

}  // namespace

absl::StatusOr<ProjectionWeights> LoadProjectionWeights(
    const ProjectionSource& source) {
  auto file = SafetensorsFile::Open(source.path);
  if (!file.ok()) return file.status();
  if (file->tensors().count(source.weight_tensor) == 0) {
    return absl::NotFoundError(absl::StrCat(source.path, ": no tensor '",
                                            source.weight_tensor,
                                            "' (--projection_weight_tensor)"));
  }
  ProjectionWeights weights;
  auto weight =
      ReadF32(*file, source.weight_tensor,
              {kernels::kProjectionOutDim, kernels::kProjectionInDim});
  if (!weight.ok()) return weight.status();
  weights.weight = *std::move(weight);
  if (!source.bias_tensor.empty() &&
      file->tensors().count(source.bias_tensor)) {
    auto bias =
        ReadF32(*file, source.bias_tensor, {kernels::kProjectionOutDim});
    if (!bias.ok()) return bias.status();
    weights.bias = *std::move(bias);
  }
  weights.description =
      absl::StrCat(source.path, " (", source.weight_tensor,
                   weights.bias.empty() ? ", no bias" : ", bias", ")");
  ComputeDigest(&weights);
  return weights;
}

ProjectionWeights SyntheticProjectionWeights(uint64_t seed) {
  ProjectionWeights weights;
  kernels::RandomNormal random(seed);
  weights.weight.resize(kernels::kProjectionOutDim * kernels::kProjectionInDim);
  for (float& w : weights.weight) w = random.Next(0.1f);
  weights.bias.resize(kernels::kProjectionOutDim);
  for (float& b : weights.bias) b = random.Next(0.1f);
  weights.description =
      absl::StrCat("embedded synthetic H3 projection (seed ", seed, ")");
  ComputeDigest(&weights);
  return weights;
}

}  // namespace detlogp::server
