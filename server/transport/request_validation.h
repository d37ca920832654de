// Turns a LogProbRequest into rows the batcher can run, or says precisely
// which field is wrong. Pure: no server state, safe to fuzz.
#ifndef DETLOGP_SERVER_TRANSPORT_REQUEST_VALIDATION_H_
#define DETLOGP_SERVER_TRANSPORT_REQUEST_VALIDATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::server {

struct RequestLimits {
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;        // real vocabulary: targets must be below it
  int64_t max_request_rows = 0;  // larger requests are refused
  int64_t max_top_k = 0;         // --max_top_k: larger top_k is refused
  // Non-empty: the backend computes no entropy or top-k, and why
  // (BackendDescription::extras_unavailable); asking for them is refused.
  std::string extras_unavailable;
};

struct ValidatedRows {
  int64_t rows = 0;
  // [rows, hidden_size] bf16, little-endian, any alignment: the request's own
  // bytes when it sent bf16 (valid while the request lives), else `converted`.
  const char* hidden_bf16 = nullptr;
  std::vector<uint16_t> converted;  // RNE from fp32 / fp16 input
  std::vector<int32_t> targets;
  float temperature = 1.0f;
  bool return_lse = false;
  bool return_entropy = false;
  int32_t top_k = 0;  // in [0, min(max_top_k, vocab_size)]
};

// INVALID_ARGUMENT naming the field for every malformed request;
// FAILED_PRECONDITION naming return_entropy or top_k when the request asks
// for extras the backend does not compute (limits.extras_unavailable).
absl::StatusOr<ValidatedRows> ValidateLogProbRequest(
    const detlogp::v1::LogProbRequest& request, const RequestLimits& limits);

// Decodes a Tensor's elements to bf16 bits (round-to-nearest-even from fp32,
// exact widening then RNE from fp16). `data` size must already be checked.
void DecodeToBf16(detlogp::v1::DType dtype, const std::string& data,
                  int64_t elements, uint16_t* out);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_REQUEST_VALIDATION_H_
