// Weights of the MiniMax-H3 video input projection (W [5376, 96] fp32, optional
// bias [5376]) and their digest.
#ifndef DETLOGP_SERVER_MODELS_PROJECTION_WEIGHTS_H_
#define DETLOGP_SERVER_MODELS_PROJECTION_WEIGHTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace detlogp::server {

struct ProjectionWeights {
  std::vector<float> weight;  // [5376, 96]
  std::vector<float> bias;    // [5376] or empty
  std::string sha256;
  std::string description;
};

struct ProjectionSource {
  std::string path;  // a .safetensors file
  std::string weight_tensor = "proj.weight";
  std::string bias_tensor = "proj.bias";  // used when present in the file
};

absl::StatusOr<ProjectionWeights> LoadProjectionWeights(
    const ProjectionSource& source);

// Seeded synthetic weights (W ~ N(0, 0.1^2), bias ~ N(0, 0.1^2)).
ProjectionWeights SyntheticProjectionWeights(uint64_t seed = 20261130);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_MODELS_PROJECTION_WEIGHTS_H_
