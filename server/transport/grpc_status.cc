#include "server/transport/grpc_status.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "proto/status_details.h"

namespace detlogp::server {

namespace {

// The field a message names by the server's convention ("<field>: ..."):
// a path of identifiers, dots and [index] parts; empty when it names none.
absl::string_view LeadingField(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return {};
  const absl::string_view field = message.substr(0, colon);
  bool start = true;
  for (const char c : field) {
    const bool word = absl::ascii_isalpha(c) || c == '_' ||
                      (!start && absl::ascii_isdigit(c));
    if (word || (!start && (c == '.' || c == '[' || c == ']'))) {
      start = c == '.';
      continue;
    }
    return {};
  }
  return start ? absl::string_view() : field;
}

// Errors built without FieldError still name their field first: they get
// the BadRequest too, so that clients read every field from the details.
absl::Status WithFieldDetail(const absl::Status& status) {
  if (!v1::DetailsOf(status).fields.empty()) return status;
  const absl::string_view field = LeadingField(status.message());
  if (field.empty()) return status;
  const v1::ErrorDetails details = v1::DetailsOf(status);
  const bool own_reason = details.reason != v1::CodeName(status.code());
  absl::Status named = v1::FieldError(
      status.code(), field, status.message().substr(field.size() + 2),
      own_reason ? details.reason : v1::kReasonInvalidField, details.metadata);
  status.ForEachPayload(
      [&](absl::string_view type_url, const absl::Cord& value) {
        if (!named.GetPayload(type_url).has_value()) {
          named.SetPayload(type_url, value);
        }
      });
  return named;
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& given,
                          grpc::ServerContextBase* context) {
  if (given.ok()) return grpc::Status::OK;
  const absl::Status status = WithFieldDetail(given);
  // absl and gRPC share the canonical code numbering (0..16).
  const int code = static_cast<int>(status.code());
  const grpc::StatusCode grpc_code = code >= 0 && code <= 16
                                         ? static_cast<grpc::StatusCode>(code)
                                         : grpc::StatusCode::UNKNOWN;
  if (context != nullptr) {
    const v1::ErrorDetails details = v1::DetailsOf(status);
    if (details.retry_delay.has_value()) {
      context->AddTrailingMetadata(
          "grpc-retry-pushback-ms",
          absl::StrCat(absl::ToInt64Milliseconds(*details.retry_delay)));
    }
  }
  return grpc::Status(grpc_code, std::string(status.message()),
                      v1::SerializeStatusDetails(status));
}

}  // namespace detlogp::server
