// Turns a LogProbRequest into rows the batcher can run, or says precisely
// which field is wrong. Pure: no server state, safe to fuzz.
#ifndef DETLOGP_SERVER_TRANSPORT_REQUEST_VALIDATION_H_
#define DETLOGP_SERVER_TRANSPORT_REQUEST_VALIDATION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.pb.h"
#include "server/backends/hidden_location.h"

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

// The bytes a Tensor.shared_memory reference names, held (the region stays
// mapped, counted in use) while `hold` lives.
struct SharedMemoryBytes {
  const char* data = nullptr;
  HiddenLocation location;
  std::shared_ptr<const void> hold;
};

// Resolves a reference whose byte_size already matches the tensor's shape:
// NOT_FOUND or INVALID_ARGUMENT naming hidden.shared_memory.<field>.
using SharedMemoryResolver = std::function<absl::StatusOr<SharedMemoryBytes>(
    const detlogp::v1::SharedMemoryRef& ref)>;

struct ValidatedRows {
  int64_t rows = 0;
  // [rows, hidden_size] bf16, little-endian, any alignment: the request's own
  // bytes when it sent bf16 (valid while the request lives), the region's
  // bytes (valid while `region_hold` lives), else `converted`. Null when
  // `hidden_pieces` holds them.
  const char* hidden_bf16 = nullptr;
  // The bf16 rows as the message's pieces (ValidateLogProbRequest's
  // `message_rows`), in order.
  std::vector<absl::string_view> hidden_pieces;
  // Where hidden_bf16 points: a device when it names a CUDA region.
  HiddenLocation location;
  // Set when the rows came from a shared-memory region.
  std::shared_ptr<const void> region_hold;
  // How the tensor's bytes arrived, and how many (before any conversion).
  enum class Source { kMessage, kSystemRegion, kCudaRegion };
  Source source = Source::kMessage;
  int64_t hidden_bytes = 0;
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
// hidden.shared_memory is resolved through `resolve` once everything else
// is checked; without one such a request gets FAILED_PRECONDITION naming
// hidden.shared_memory. fp32 / fp16 rows in a region are decoded here, read
// through ReadFromMapping when the region's owner may truncate it:
// FAILED_PRECONDITION naming hidden.shared_memory when it did.
//
// `message_rows`, when given, are hidden.data's bytes in pieces (the request
// itself then carries none: SplitHiddenData); bf16 rows stay in them.
absl::StatusOr<ValidatedRows> ValidateLogProbRequest(
    const detlogp::v1::LogProbRequest& request, const RequestLimits& limits,
    const SharedMemoryResolver& resolve = nullptr,
    const std::vector<absl::string_view>* message_rows = nullptr);

// Decodes a Tensor's elements to bf16 bits (round-to-nearest-even from fp32,
// exact widening then RNE from fp16). `data` (host memory) must hold them.
void DecodeToBf16(detlogp::v1::DType dtype, const char* data, int64_t elements,
                  uint16_t* out);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_REQUEST_VALIDATION_H_
