// The error model of detlogp.v1: every non-OK status carries typed details
// (gRPC's richer error model, google.rpc.Status), so that clients decide
// from a stable reason, a field path and a retry delay, never from message
// text.
//
// Inside the server and the clients the details ride on absl::Status as
// payloads keyed by their type URL (the serialized google.rpc message), so
// that they survive every `return status;` on the way to the one place a
// status becomes a gRPC status (ToGrpcStatus) and back (FromGrpcStatus).
//
//   return WithReason(absl::ResourceExhaustedError("queue full: ..."),
//                     kReasonQueueFull, {{"limit", "65536"}},
//                     /*retry_delay=*/absl::Milliseconds(40));
//   return FieldError(absl::StatusCode::kInvalidArgument, "top_k",
//                     "-1 is negative");  // "top_k: -1 is negative"
//
//   ErrorDetails details = DetailsOf(status);  // on either side
//   if (details.reason == kReasonQueueFull) ... details.retry_delay ...
#ifndef DETLOGP_PROTO_STATUS_DETAILS_H_
#define DETLOGP_PROTO_STATUS_DETAILS_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace detlogp::v1 {

// ErrorInfo.domain of every detlogp error.
inline constexpr absl::string_view kErrorDomain = "detlogp.v1";

// ErrorInfo.reason values. They are API (docs/api.md, "Errors"): new ones
// may be added, none is renamed. A status given no reason of its own gets
// the name of its code ("INVALID_ARGUMENT", "NOT_FOUND", ...).
inline constexpr absl::string_view kReasonQueueFull = "QUEUE_FULL";
inline constexpr absl::string_view kReasonRowsOverLimit = "ROWS_OVER_LIMIT";
inline constexpr absl::string_view kReasonMessageTooLarge = "MESSAGE_TOO_LARGE";
inline constexpr absl::string_view kReasonInvalidField = "INVALID_FIELD";
inline constexpr absl::string_view kReasonRegionRefused = "REGION_REFUSED";
inline constexpr absl::string_view kReasonRegionGone = "REGION_GONE";
inline constexpr absl::string_view kReasonModelNotFound = "MODEL_NOT_FOUND";
inline constexpr absl::string_view kReasonVersionUnavailable =
    "VERSION_UNAVAILABLE";
inline constexpr absl::string_view kReasonWeightsMismatch = "WEIGHTS_MISMATCH";
inline constexpr absl::string_view kReasonShuttingDown = "SHUTTING_DOWN";
// A delta upload names a base version this server does not hold (or holds
// with another digest): send the whole head.
inline constexpr absl::string_view kReasonBaseMissing = "BASE_MISSING";

// Everything the details of a status say (empty parts: not said).
struct ErrorDetails {
  std::string reason;
  std::string domain;
  std::map<std::string, std::string> metadata;
  // BadRequest field paths, in order.
  std::vector<std::string> fields;
  // RetryInfo: the call can succeed after this long.
  std::optional<absl::Duration> retry_delay;
};

// `status` with an ErrorInfo of `reason` (domain kErrorDomain) and, when
// given, a RetryInfo. OK stays OK.
absl::Status WithReason(absl::Status status, absl::string_view reason,
                        const std::map<std::string, std::string>& metadata = {},
                        std::optional<absl::Duration> retry_delay = {});

// `code` with the message "<field>: <detail>", a BadRequest naming `field`
// and the reason INVALID_FIELD (or `reason` when given).
absl::Status FieldError(
    absl::StatusCode code, absl::string_view field, absl::string_view detail,
    absl::string_view reason = kReasonInvalidField,
    const std::map<std::string, std::string>& metadata = {});

// What `status` carries; the reason defaults to its code's name.
ErrorDetails DetailsOf(const absl::Status& status);

// The serialized google.rpc.Status for `status` (code, message and every
// detail, ErrorInfo always among them): grpc::Status::error_details().
std::string SerializeStatusDetails(const absl::Status& status);

// The status a peer sent: `code` and `message` with the details in
// `serialized_details` (a google.rpc.Status; empty or unreadable: none).
absl::Status StatusWithDetails(absl::StatusCode code, absl::string_view message,
                               absl::string_view serialized_details);

// The canonical name of `code` ("RESOURCE_EXHAUSTED").
std::string CodeName(absl::StatusCode code);

}  // namespace detlogp::v1

#endif  // DETLOGP_PROTO_STATUS_DETAILS_H_
