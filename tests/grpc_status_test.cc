#include "server/transport/grpc_status.h"

#include <string>

#include "gtest/gtest.h"
#include "proto/status_details.h"

namespace detlogp::server {
namespace {

v1::ErrorDetails SentDetails(const absl::Status& status) {
  const grpc::Status sent = ToGrpcStatus(status);
  return v1::DetailsOf(
      v1::StatusWithDetails(static_cast<absl::StatusCode>(sent.error_code()),
                            sent.error_message(), sent.error_details()));
}

TEST(ToGrpcStatusTest, KeepsCodeMessageAndDetails) {
  const absl::Status status =
      v1::FieldError(absl::StatusCode::kInvalidArgument, "hidden.shape[0]",
                     "too many", v1::kReasonRowsOverLimit, {{"limit", "8"}});
  const grpc::Status sent = ToGrpcStatus(status);
  EXPECT_EQ(sent.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(sent.error_message(), "hidden.shape[0]: too many");
  const v1::ErrorDetails details = SentDetails(status);
  EXPECT_EQ(details.reason, v1::kReasonRowsOverLimit);
  EXPECT_EQ(details.metadata.at("limit"), "8");
  EXPECT_EQ(details.fields, std::vector<std::string>{"hidden.shape[0]"});
}

TEST(ToGrpcStatusTest, AMessageNamingItsFieldGetsTheFieldDetail) {
  const v1::ErrorDetails details = SentDetails(absl::FailedPreconditionError(
      "header.hidden_size: the model serves hidden_size=64"));
  EXPECT_EQ(details.fields, std::vector<std::string>{"header.hidden_size"});
  EXPECT_EQ(details.reason, v1::kReasonInvalidField);
  // Its own reason stays.
  const v1::ErrorDetails kept = SentDetails(v1::WithReason(
      absl::NotFoundError("target_ids[3]: gone"), v1::kReasonRegionGone));
  EXPECT_EQ(kept.fields, std::vector<std::string>{"target_ids[3]"});
  EXPECT_EQ(kept.reason, v1::kReasonRegionGone);
}

TEST(ToGrpcStatusTest, AMessageNamingNoFieldGetsNone) {
  for (const char* message :
       {"queue full: 8 rows waiting", "server is shutting down",
        "shared memory: the caller is remote", ": empty", "3d: digits first",
        "a..b: empty step"}) {
    const v1::ErrorDetails details =
        SentDetails(absl::InvalidArgumentError(message));
    EXPECT_TRUE(details.fields.empty()) << message;
    EXPECT_EQ(details.reason, "INVALID_ARGUMENT") << message;
  }
}

TEST(ToGrpcStatusTest, OkIsOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

}  // namespace
}  // namespace detlogp::server
