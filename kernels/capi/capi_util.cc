#include "kernels/capi/capi_util.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/split_policy.h"
#include "digests/determinism_key.h"
#include "digests/lm_head_digest.h"

namespace detlogp::capi {

int Fail(const std::string& message, char* error, size_t error_len) {
  if (error != nullptr && error_len > 0) {
    const size_t n = std::min(message.size(), error_len - 1);
    std::memcpy(error, message.data(), n);
    error[n] = '\0';
  }
  return 1;
}

void ClearError(char* error, size_t error_len) {
  if (error != nullptr && error_len > 0) error[0] = '\0';
}

std::string CheckHead(const void* weight, int64_t padded_vocab_size,
                      int64_t hidden_size, int64_t vocab_size) {
  if (weight == nullptr) return "weight: null pointer";
  if (hidden_size <= 0) {
    return absl::StrCat("hidden_size: must be positive, got ", hidden_size);
  }
  if (padded_vocab_size <= 0) {
    return absl::StrCat("padded_vocab_size: must be positive, got ",
                        padded_vocab_size);
  }
  if (vocab_size <= 0 || vocab_size > padded_vocab_size) {
    return absl::StrCat("vocab_size: must be in [1, ", padded_vocab_size,
                        "] (the weight's rows), got ", vocab_size);
  }
  if (vocab_size > INT32_MAX) {
    return absl::StrCat("vocab_size: exceeds int32 targets, got ", vocab_size);
  }
  return "";
}

int WriteDeterminismKey(const BackendIdentity& identity, const uint16_t* weight,
                        int64_t padded_vocab_size, int64_t hidden_size,
                        const float* bias, int64_t vocab_size, char* key,
                        size_t key_len, char* error, size_t error_len) {
  const std::string bad =
      CheckHead(weight, padded_vocab_size, hidden_size, vocab_size);
  if (!bad.empty()) return Fail(bad, error, error_len);
  if (key == nullptr) return Fail("key: null pointer", error, error_len);
  digests::LmHeadShape shape;
  shape.hidden_size = hidden_size;
  shape.vocab_size = vocab_size;
  shape.padded_vocab_size = padded_vocab_size;
  shape.has_bias = bias != nullptr;
  // As the server: the weights' digest (lm_head_weights.cc), then the key
  // over the backend's description (server.cc, model_manager.cc).
  digests::DeterminismInputs inputs;
  inputs.weights_sha256 = digests::ComputeLmHeadDigest(shape, weight, bias);
  inputs.backend = identity.backend;
  inputs.instruction_set = identity.instruction_set;
  inputs.kernel_version = identity.kernel_version;
  inputs.split_policy = kernels::kSplitPolicyName;
  const std::string result = digests::DeterminismKey(inputs);
  if (key_len < result.size() + 1) {
    return Fail(absl::StrCat("key_len: need at least ", result.size() + 1,
                             " bytes, got ", key_len),
                error, error_len);
  }
  std::memcpy(key, result.c_str(), result.size() + 1);
  return 0;
}

}  // namespace detlogp::capi
