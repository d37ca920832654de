// libFuzzer target over request validation
// (server/transport/request_validation.h).
//
// Input: one selector byte choosing the server limits, then a serialized
// detlogp.v1.LogProbRequest. Bytes that do not parse are skipped (gRPC
// refuses them before validation). For every parsed request it checks:
//   * an error is INVALID_ARGUMENT and its message starts with a field name
//     (or, for a request naming a shared-memory region, which this
//     validation has no regions for, FAILED_PRECONDITION naming
//     hidden.shared_memory);
//   * a success has rows == shape[0] <= max_request_rows, N*H bf16 values,
//     N targets in [0, vocab_size), a finite positive temperature, and fp32
//     inputs rounded to bf16 exactly as a reference round-to-nearest-even,
//     bf16 inputs passed through bit-exactly (ASan checks every read).
// The same bytes, cut in two, go through SplitHiddenData
// (server/transport/request_wire.h), which must agree with protobuf: a
// message protobuf refuses is never split; a split one gives the parsed
// request less hidden.data and hidden.data's bytes, and validating it with
// those pieces gives the same status, or the same rows, as the whole.
// Any violation aborts, which libFuzzer reports as a crash with its input.
//
// Built outside Bazel by build_fuzzer.sh (clang++ -fsanitize=fuzzer,address).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"
#include "server/transport/request_validation.h"
#include "server/transport/request_wire.h"

namespace {

using detlogp::server::RequestLimits;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "request_validation_fuzzer: %s\n", what.c_str());
  std::abort();
}

uint16_t ReferenceBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

bool StartsWithField(const std::string& message) {
  static const char* kFields[] = {
      "hidden.dtype:",    "hidden.shape:",
      "hidden.shape[0]:", "hidden.shape[1]:",
      "hidden.data:",     "hidden.shared_memory.byte_size:",
      "target_ids:",      "target_ids[",
      "temperature:",     "top_k:"};
  for (const char* field : kFields) {
    if (message.rfind(field, 0) == 0) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const RequestLimits kLimits[] = {
      {8, 100, 64, 20},  // the seed corpus is written for this one
      {1, 1, 1, 32},     // --max_top_k above the vocabulary
      {16, 50000, 4, 0},
      {3, 7, 1024, 20},
  };
  const RequestLimits& limits = kLimits[data[0] % 4];
  const absl::string_view bytes(reinterpret_cast<const char*>(data + 1),
                                size - 1);
  const size_t cut = (data[0] >> 2) * bytes.size() / 64;
  const absl::string_view chunks[] = {bytes.substr(0, cut), bytes.substr(cut)};
  const auto split = detlogp::server::SplitHiddenData(chunks);
  detlogp::v1::LogProbRequest request;
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    if (split.has_value()) Fail("split a message protobuf refuses");
    return 0;
  }

  auto result = detlogp::server::ValidateLogProbRequest(request, limits);
  if (split.has_value()) {
    std::string joined;
    for (absl::string_view piece : split->data) {
      joined.append(piece.data(), piece.size());
    }
    detlogp::v1::LogProbRequest without_data = request;
    without_data.mutable_hidden()->clear_data();
    if (joined != request.hidden().data() ||
        split->header.SerializeAsString() != without_data.SerializeAsString()) {
      Fail("the split request differs from protobuf's");
    }
    auto from_pieces = detlogp::server::ValidateLogProbRequest(
        split->header, limits, nullptr, &split->data);
    if (from_pieces.status() != result.status()) {
      Fail("validating the pieces gives " + from_pieces.status().ToString() +
           ", the whole " + result.status().ToString());
    }
    if (result.ok()) {
      std::string from_whole;
      std::string from_split;
      const size_t rows_bytes =
          static_cast<size_t>(result->rows * limits.hidden_size * 2);
      if (rows_bytes > 0) from_whole.assign(result->hidden_bf16, rows_bytes);
      if (from_pieces->hidden_bf16 != nullptr && rows_bytes > 0) {
        from_split.assign(from_pieces->hidden_bf16, rows_bytes);
      } else {
        for (absl::string_view piece : from_pieces->hidden_pieces) {
          from_split.append(piece.data(), piece.size());
        }
      }
      if (from_whole != from_split) Fail("the pieces' rows differ");
    }
  }
  if (!result.ok()) {
    const std::string message(result.status().message());
    // Validation runs without shared memory here: a well-formed request
    // naming a region is one this server cannot serve.
    const bool names_a_region =
        request.hidden().has_shared_memory() &&
        result.status().code() == absl::StatusCode::kFailedPrecondition &&
        message.rfind("hidden.shared_memory:", 0) == 0;
    if (result.status().code() != absl::StatusCode::kInvalidArgument &&
        !names_a_region) {
      Fail("error is not INVALID_ARGUMENT: " + result.status().ToString());
    }
    if (names_a_region) return 0;
    if (!StartsWithField(message)) Fail("error names no field: " + message);
    return 0;
  }
  const auto& rows = *result;
  const auto& hidden = request.hidden();
  if (hidden.shape_size() != 2 || rows.rows != hidden.shape(0) ||
      rows.rows < 0 || rows.rows > limits.max_request_rows ||
      hidden.shape(1) != limits.hidden_size) {
    Fail("accepted a request whose shape breaks the limits");
  }
  const size_t elements = static_cast<size_t>(rows.rows * limits.hidden_size);
  if (elements > 0 && rows.hidden_bf16 == nullptr) Fail("no bf16 values");
  // The bf16 view is [rows, H], little-endian, any alignment.
  auto bf16_at = [&rows](size_t i) {
    uint16_t v;
    std::memcpy(&v, rows.hidden_bf16 + 2 * i, 2);
    return v;
  };
  if (static_cast<int64_t>(rows.targets.size()) != rows.rows)
    Fail("wrong target count");
  for (int32_t t : rows.targets) {
    if (t < 0 || t >= limits.vocab_size)
      Fail("accepted an out-of-range target");
  }
  if (rows.top_k < 0 || rows.top_k > limits.max_top_k ||
      rows.top_k > limits.vocab_size || rows.top_k != request.top_k()) {
    Fail("accepted a top_k outside [0, min(max_top_k, vocab_size)]");
  }
  if (!std::isfinite(rows.temperature) || rows.temperature <= 0) {
    Fail("accepted a temperature that is not finite and positive");
  }
  if (hidden.dtype() == detlogp::v1::DTYPE_FLOAT32) {
    for (size_t i = 0; i < elements; ++i) {
      float value;
      std::memcpy(&value, hidden.data().data() + 4 * i, 4);
      if (bf16_at(i) != ReferenceBf16(value)) Fail("fp32 -> bf16 not RNE");
    }
  } else if (hidden.dtype() == detlogp::v1::DTYPE_FLOAT16) {
    for (size_t i = 0; i < elements; ++i) (void)bf16_at(i);  // ASan: in bounds
  } else if (hidden.dtype() == detlogp::v1::DTYPE_BFLOAT16) {
    if (elements > 0 && std::memcmp(rows.hidden_bf16, hidden.data().data(),
                                    2 * elements) != 0) {
      Fail("bf16 input not passed through bit-exactly");
    }
  }
  return 0;
}
