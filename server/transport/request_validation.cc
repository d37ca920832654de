#include "server/transport/request_validation.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/bfloat16.h"
#include "server/shared_memory/mapped_reads.h"
#include "proto/dtype_bytes.h"
#include "proto/status_details.h"

namespace detlogp::server {
namespace {

using detlogp::v1::DType;

}  // namespace

void DecodeToBf16(DType dtype, const char* bytes, int64_t elements,
                  uint16_t* out) {
  if (dtype == detlogp::v1::DTYPE_BFLOAT16) {
    std::memcpy(out, bytes, elements * 2);
    return;
  }
  for (int64_t i = 0; i < elements; ++i) {
    if (dtype == detlogp::v1::DTYPE_FLOAT16) {
      uint16_t half;
      std::memcpy(&half, bytes + 2 * i, 2);
      out[i] = kernels::FloatToBf16(kernels::Fp16ToFloat(half));
    } else {
      float value;
      std::memcpy(&value, bytes + 4 * i, 4);
      out[i] = kernels::FloatToBf16(value);
    }
  }
}

absl::StatusOr<ValidatedRows> ValidateLogProbRequest(
    const detlogp::v1::LogProbRequest& request, const RequestLimits& limits,
    const SharedMemoryResolver& resolve,
    const std::vector<absl::string_view>* message_rows) {
  const detlogp::v1::Tensor& hidden = request.hidden();
  int64_t data_bytes = static_cast<int64_t>(hidden.data().size());
  if (message_rows != nullptr) {
    for (absl::string_view piece : *message_rows) {
      data_bytes += static_cast<int64_t>(piece.size());
    }
  }
  if (!detlogp::v1::DType_IsValid(hidden.dtype()) ||
      detlogp::v1::DTypeBytes(hidden.dtype()) == 0) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "hidden.dtype",
        absl::StrCat(hidden.dtype(),
                     " is not DTYPE_FLOAT32, DTYPE_BFLOAT16 or DTYPE_FLOAT16"));
  }
  if (hidden.shape_size() != 2) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "hidden.shape",
        absl::StrCat("expected rank 2 [N, H], got rank ", hidden.shape_size()));
  }
  const int64_t rows = hidden.shape(0);
  const int64_t hidden_size = hidden.shape(1);
  if (rows < 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "hidden.shape[0]",
                          absl::StrCat("N=", rows, " is negative"));
  }
  if (hidden_size != limits.hidden_size) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "hidden.shape[1]",
        absl::StrCat(
            "H=", hidden_size,
            " does not match the model's hidden_size=", limits.hidden_size));
  }
  if (rows > limits.max_request_rows) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "hidden.shape[0]",
        absl::StrCat("N=", rows, " rows exceeds the server's limit of ",
                     limits.max_request_rows,
                     " rows per request (--max_request_rows); ",
                     "split the request"),
        v1::kReasonRowsOverLimit,
        {{"limit", absl::StrCat(limits.max_request_rows)},
         {"requested", absl::StrCat(rows)}});
  }
  const int64_t expected_bytes =
      rows * hidden_size * detlogp::v1::DTypeBytes(hidden.dtype());
  const bool shared = hidden.has_shared_memory();
  if (shared) {
    if (data_bytes != 0) {
      return v1::FieldError(
          absl::StatusCode::kInvalidArgument, "hidden.data",
          absl::StrCat(data_bytes,
                       " bytes, but hidden.shared_memory is set (one or the "
                       "other)"));
    }
    if (hidden.shared_memory().byte_size() != expected_bytes) {
      return v1::FieldError(
          absl::StatusCode::kInvalidArgument, "hidden.shared_memory.byte_size",
          absl::StrCat(
              hidden.shared_memory().byte_size(), " bytes, expected N*H*",
              detlogp::v1::DTypeBytes(hidden.dtype()), " = ", expected_bytes));
    }
  } else if (data_bytes != expected_bytes) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "hidden.data",
                          absl::StrCat(data_bytes, " bytes, expected N*H*",
                                       detlogp::v1::DTypeBytes(hidden.dtype()),
                                       " = ", expected_bytes));
  }
  if (request.target_ids_size() != rows) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "target_ids",
        absl::StrCat(request.target_ids_size(), " ids for N=", rows, " rows"));
  }
  ValidatedRows validated;
  validated.rows = rows;
  validated.targets.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t target = request.target_ids(r);
    if (target < 0 || target >= limits.vocab_size) {
      return v1::FieldError(
          absl::StatusCode::kInvalidArgument,
          absl::StrCat("target_ids[", r, "]"),
          absl::StrCat(target, " is outside [0, ", limits.vocab_size, ")"));
    }
    validated.targets[r] = static_cast<int32_t>(target);
  }
  const float temperature = request.temperature();
  if (std::isnan(temperature) || std::isinf(temperature) || temperature < 0) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "temperature",
        absl::StrCat(temperature, " must be finite and >= 0 (0 means 1)"));
  }
  validated.temperature = temperature == 0.0f ? 1.0f : temperature;
  validated.return_lse = request.return_lse();
  validated.return_entropy = request.return_entropy();
  const int64_t top_k = request.top_k();
  if (top_k < 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "top_k",
                          absl::StrCat(top_k, " is negative (0 means none)"));
  }
  if (top_k > limits.max_top_k) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "top_k",
                          absl::StrCat(top_k, " exceeds the server's limit of ",
                                       limits.max_top_k, " (--max_top_k)"));
  }
  if (top_k > limits.vocab_size) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "top_k",
        absl::StrCat(top_k,
                     " exceeds the model's vocab_size=", limits.vocab_size));
  }
  validated.top_k = static_cast<int32_t>(top_k);
  // A well-formed request this backend cannot answer (none does today):
  // refused, never silently answered without the extras.
  if (!limits.extras_unavailable.empty()) {
    if (validated.return_entropy) {
      return v1::FieldError(absl::StatusCode::kFailedPrecondition,
                            "return_entropy",
                            absl::StrCat(limits.extras_unavailable));
    }
    if (validated.top_k > 0) {
      return v1::FieldError(absl::StatusCode::kFailedPrecondition, "top_k",
                            absl::StrCat(limits.extras_unavailable));
    }
  }
  validated.hidden_bytes = expected_bytes;
  const char* bytes = hidden.data().data();
  std::string joined;  // pieces of rows to convert, in one buffer
  if (message_rows != nullptr && !shared) {
    if (hidden.dtype() == detlogp::v1::DTYPE_BFLOAT16) {
      validated.hidden_pieces = *message_rows;  // no copy
      return validated;
    }
    joined.reserve(expected_bytes);
    for (absl::string_view piece : *message_rows) {
      joined.append(piece.data(), piece.size());
    }
    bytes = joined.data();
  }
  if (shared) {
    if (!resolve) {
      return v1::FieldError(
          absl::StatusCode::kFailedPrecondition, "hidden.shared_memory",
          "shared memory is off on this server "
          "(--allow_shared_memory), or the caller is not on its host");
    }
    auto region = resolve(hidden.shared_memory());
    if (!region.ok()) return region.status();
    if (region->location.kind == HiddenLocation::Kind::kDevice &&
        hidden.dtype() != detlogp::v1::DTYPE_BFLOAT16) {
      return v1::FieldError(absl::StatusCode::kInvalidArgument, "hidden.dtype",
                            "a CUDA shared-memory region must hold "
                            "DTYPE_BFLOAT16 (no conversion on the device)");
    }
    bytes = region->data;
    validated.source = region->location.kind == HiddenLocation::Kind::kDevice
                           ? ValidatedRows::Source::kCudaRegion
                           : ValidatedRows::Source::kSystemRegion;
    validated.location = region->location;
    validated.region_hold = std::move(region->hold);
  }
  if (hidden.dtype() == detlogp::v1::DTYPE_BFLOAT16) {
    validated.hidden_bf16 = bytes;  // no copy
  } else {
    // Converted rows live in host memory, wherever they came from.
    const HiddenLocation read_from = std::move(validated.location);
    validated.location = HiddenLocation();
    validated.converted.resize(rows * hidden_size);
    const auto decode = [&] {
      DecodeToBf16(hidden.dtype(), bytes, rows * hidden_size,
                   validated.converted.data());
    };
    if (!read_from.owner_may_truncate) {
      decode();
    } else if (!ReadFromMapping(bytes, expected_bytes, decode).ok()) {
      return RegionShrankError("hidden.shared_memory", read_from.region);
    }
    validated.region_hold.reset();  // the region is read: let it go
    validated.hidden_bf16 =
        reinterpret_cast<const char*>(validated.converted.data());
  }
  return validated;
}

}  // namespace detlogp::server
