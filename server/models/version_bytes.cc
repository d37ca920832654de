#include "server/models/version_bytes.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"

namespace detlogp::server {

absl::StatusOr<std::unique_ptr<VersionBytes>> VersionBytes::Open(
    const ServedVersion& version, const FileLoader& load_files) {
  std::unique_ptr<VersionBytes> bytes(new VersionBytes());
  bytes->weight_bytes_ = version.padded_vocab_size * version.hidden_size *
                         static_cast<int64_t>(sizeof(uint16_t));
  bytes->total_bytes_ =
      bytes->weight_bytes_ +
      (version.has_bias
           ? version.padded_vocab_size * static_cast<int64_t>(sizeof(float))
           : 0);
  if (auto held = version.host_weights.lock(); held != nullptr) {
    bytes->host_ = std::move(held);
    bytes->source_ = "host copy";
    return bytes;
  }
  absl::Status placed_refusal = absl::UnimplementedError("no placed model");
  if (version.placed != nullptr) {
    placed_refusal = version.placed->ReadWeights(0, 0, nullptr);
    if (placed_refusal.ok()) {
      bytes->placed_ = version.placed;
      bytes->source_ = "device";
      return bytes;
    }
  }
  absl::Status files_refusal = absl::NotFoundError("no files");
  if (load_files) {
    auto weights = load_files();
    if (weights.ok() && *weights != nullptr) {
      bytes->host_ = *std::move(weights);
      bytes->source_ = "files";
      return bytes;
    }
    if (!weights.ok()) files_refusal = weights.status();
  }
  return v1::FieldError(
      absl::StatusCode::kFailedPrecondition, "model_version",
      absl::StrCat("version ", version.version, " of '", version.model,
                   "' cannot be read here: no host copy, the placed model "
                   "does not read back (",
                   placed_refusal.message(),
                   "), and no files under "
                   "--model_root (",
                   files_refusal.message(), ")"),
      v1::kReasonVersionUnavailable);
}

absl::Status VersionBytes::Read(int64_t offset, int64_t size, char* out) const {
  if (offset < 0 || size < 0 || offset + size > total_bytes_) {
    return absl::OutOfRangeError(absl::StrCat(
        "bytes [", offset, ", ", offset + size, ") of ", total_bytes_));
  }
  if (placed_ != nullptr) return placed_->ReadWeights(offset, size, out);
  const char* weight = reinterpret_cast<const char*>(host_->weight.data());
  const char* bias = reinterpret_cast<const char*>(host_->bias.data());
  const int64_t from_weight =
      std::max<int64_t>(0, std::min(offset + size, weight_bytes_) - offset);
  if (from_weight > 0) std::memcpy(out, weight + offset, from_weight);
  if (size > from_weight) {
    std::memcpy(out + from_weight,
                bias + (offset + from_weight - weight_bytes_),
                size - from_weight);
  }
  return absl::OkStatus();
}

}  // namespace detlogp::server
