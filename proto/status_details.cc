#include "proto/status_details.h"

#include <cstdint>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace detlogp::v1 {
namespace {

constexpr absl::string_view kTypeUrlPrefix = "type.googleapis.com/";

template <typename Message>
std::string TypeUrl() {
  return std::string(kTypeUrlPrefix) + Message::descriptor()->full_name();
}

template <typename Message>
std::optional<Message> Payload(const absl::Status& status) {
  auto bytes = status.GetPayload(TypeUrl<Message>());
  if (!bytes.has_value()) return std::nullopt;
  Message message;
  if (!message.ParseFromString(std::string(*bytes))) return std::nullopt;
  return message;
}

// ErrorInfo.metadata is a map: its entries are written in key order, so
// that equal details are equal bytes (and equal statuses compare equal).
std::string DeterministicBytes(const google::protobuf::Message& message) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    message.SerializeToCodedStream(&coded);
  }
  return bytes;
}

template <typename Message>
void SetPayload(absl::Status& status, const Message& message) {
  status.SetPayload(TypeUrl<Message>(),
                    absl::Cord(DeterministicBytes(message)));
}

google::protobuf::Duration ToProtoDuration(absl::Duration delay) {
  google::protobuf::Duration out;
  const int64_t nanos = absl::ToInt64Nanoseconds(delay);
  out.set_seconds(nanos / 1000000000);
  out.set_nanos(static_cast<int32_t>(nanos % 1000000000));
  return out;
}

}  // namespace

std::string CodeName(absl::StatusCode code) {
  return absl::AsciiStrToUpper(absl::StatusCodeToString(code));
}

absl::Status WithReason(absl::Status status, absl::string_view reason,
                        const std::map<std::string, std::string>& metadata,
                        std::optional<absl::Duration> retry_delay) {
  if (status.ok()) return status;
  google::rpc::ErrorInfo info;
  info.set_reason(std::string(reason));
  info.set_domain(std::string(kErrorDomain));
  for (const auto& [key, value] : metadata)
    (*info.mutable_metadata())[key] = value;
  SetPayload(status, info);
  if (retry_delay.has_value()) {
    google::rpc::RetryInfo retry;
    *retry.mutable_retry_delay() = ToProtoDuration(*retry_delay);
    SetPayload(status, retry);
  }
  return status;
}

absl::Status FieldError(absl::StatusCode code, absl::string_view field,
                        absl::string_view detail, absl::string_view reason,
                        const std::map<std::string, std::string>& metadata) {
  absl::Status status(code, std::string(field) + ": " + std::string(detail));
  google::rpc::BadRequest bad_request;
  google::rpc::BadRequest::FieldViolation* violation =
      bad_request.add_field_violations();
  violation->set_field(std::string(field));
  violation->set_description(std::string(detail));
  SetPayload(status, bad_request);
  return WithReason(std::move(status), reason, metadata);
}

ErrorDetails DetailsOf(const absl::Status& status) {
  ErrorDetails details;
  if (status.ok()) return details;
  if (auto info = Payload<google::rpc::ErrorInfo>(status); info.has_value()) {
    details.reason = info->reason();
    details.domain = info->domain();
    details.metadata.insert(info->metadata().begin(), info->metadata().end());
  }
  if (details.reason.empty()) details.reason = CodeName(status.code());
  if (auto bad = Payload<google::rpc::BadRequest>(status); bad.has_value()) {
    for (const auto& violation : bad->field_violations()) {
      details.fields.push_back(violation.field());
    }
  }
  if (auto retry = Payload<google::rpc::RetryInfo>(status); retry.has_value()) {
    details.retry_delay = absl::Seconds(retry->retry_delay().seconds()) +
                          absl::Nanoseconds(retry->retry_delay().nanos());
  }
  return details;
}

std::string SerializeStatusDetails(const absl::Status& status) {
  if (status.ok()) return "";
  google::rpc::Status out;
  out.set_code(static_cast<int32_t>(status.code()));
  out.set_message(std::string(status.message()));
  bool has_error_info = false;
  status.ForEachPayload(
      [&](absl::string_view type_url, const absl::Cord& value) {
        if (!absl::StartsWith(type_url, kTypeUrlPrefix)) return;
        google::protobuf::Any* any = out.add_details();
        any->set_type_url(std::string(type_url));
        any->set_value(std::string(value));
        has_error_info |= type_url == TypeUrl<google::rpc::ErrorInfo>();
      });
  if (!has_error_info) {
    google::rpc::ErrorInfo info;
    info.set_reason(CodeName(status.code()));
    info.set_domain(std::string(kErrorDomain));
    google::protobuf::Any* any = out.add_details();
    any->set_type_url(TypeUrl<google::rpc::ErrorInfo>());
    any->set_value(info.SerializeAsString());
  }
  return DeterministicBytes(out);
}

absl::Status StatusWithDetails(absl::StatusCode code, absl::string_view message,
                               absl::string_view serialized_details) {
  absl::Status status(code, message);
  if (status.ok() || serialized_details.empty()) return status;
  google::rpc::Status details;
  if (!details.ParseFromArray(serialized_details.data(),
                              static_cast<int>(serialized_details.size()))) {
    return status;
  }
  for (const google::protobuf::Any& any : details.details()) {
    status.SetPayload(any.type_url(), absl::Cord(any.value()));
  }
  return status;
}

}  // namespace detlogp::v1
