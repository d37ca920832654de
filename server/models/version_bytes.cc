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

absl::StatusOr<std::shared_ptr<const LmHeadWeights>> VersionBytes::Weights(
    const ServedVersion& version) const {
  if (host_ != nullptr) return host_;
  auto weights = std::make_shared<LmHeadWeights>();
  weights->hidden_size = version.hidden_size;
  weights->vocab_size = version.vocab_size;
  weights->padded_vocab_size = version.padded_vocab_size;
  weights->sha256 = version.weights_sha256;
  weights->description =
      absl::StrCat("version ", version.version, " read back");
  weights->weight.resize(version.padded_vocab_size * version.hidden_size);
  if (version.has_bias) weights->bias.resize(version.padded_vocab_size);
  if (static_cast<int64_t>(weights->weight.size() * sizeof(uint16_t)) !=
          weight_bytes_ ||
      static_cast<int64_t>(weights->bias.size() * sizeof(float)) !=
          total_bytes_ - weight_bytes_) {
    return absl::InternalError("Weights: another version than Open's");
  }
  if (absl::Status s = Read(0, weight_bytes_,
                            reinterpret_cast<char*>(weights->weight.data()));
      !s.ok()) {
    return s;
  }
  if (total_bytes_ > weight_bytes_) {
    if (absl::Status s = Read(weight_bytes_, total_bytes_ - weight_bytes_,
                              reinterpret_cast<char*>(weights->bias.data()));
        !s.ok()) {
      return s;
    }
  }
  return std::shared_ptr<const LmHeadWeights>(std::move(weights));
}

}  // namespace detlogp::server
