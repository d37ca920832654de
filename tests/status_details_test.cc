#include "proto/status_details.h"

#include <map>
#include <string>

#include "gtest/gtest.h"

namespace detlogp::v1 {
namespace {

TEST(StatusDetailsTest, FieldErrorNamesTheFieldInMessageAndDetails) {
  const absl::Status status =
      FieldError(absl::StatusCode::kInvalidArgument, "top_k", "-1 is negative");
  EXPECT_EQ(status.message(), "top_k: -1 is negative");
  const ErrorDetails details = DetailsOf(status);
  EXPECT_EQ(details.reason, kReasonInvalidField);
  EXPECT_EQ(details.domain, kErrorDomain);
  EXPECT_EQ(details.fields, std::vector<std::string>{"top_k"});
  EXPECT_FALSE(details.retry_delay.has_value());
}

TEST(StatusDetailsTest, ReasonMetadataAndDelaySurviveTheWire) {
  const absl::Status sent = WithReason(
      absl::ResourceExhaustedError("queue full"), kReasonQueueFull,
      {{"limit", "65536"}, {"requested", "4096"}}, absl::Milliseconds(37));
  const std::string wire = SerializeStatusDetails(sent);
  const absl::Status received =
      StatusWithDetails(sent.code(), sent.message(), wire);
  EXPECT_EQ(received.code(), absl::StatusCode::kResourceExhausted);
  const ErrorDetails details = DetailsOf(received);
  EXPECT_EQ(details.reason, kReasonQueueFull);
  EXPECT_EQ(details.metadata.at("limit"), "65536");
  EXPECT_EQ(details.metadata.at("requested"), "4096");
  ASSERT_TRUE(details.retry_delay.has_value());
  EXPECT_EQ(*details.retry_delay, absl::Milliseconds(37));
}

TEST(StatusDetailsTest, AStatusWithoutAReasonGetsItsCodeName) {
  const absl::Status plain = absl::NotFoundError("nothing here");
  EXPECT_EQ(DetailsOf(plain).reason, "NOT_FOUND");
  // On the wire too: every status carries an ErrorInfo.
  const absl::Status received = StatusWithDetails(
      plain.code(), plain.message(), SerializeStatusDetails(plain));
  EXPECT_EQ(DetailsOf(received).reason, "NOT_FOUND");
  EXPECT_EQ(DetailsOf(received).domain, kErrorDomain);
}

TEST(StatusDetailsTest, UnreadableDetailsAreIgnored) {
  const absl::Status status = StatusWithDetails(
      absl::StatusCode::kInternal, "boom", std::string("\xff\xff\x01", 3));
  EXPECT_EQ(status.message(), "boom");
  EXPECT_EQ(DetailsOf(status).reason, "INTERNAL");
  EXPECT_TRUE(DetailsOf(status).fields.empty());
}

TEST(StatusDetailsTest, EqualDetailsMakeEqualStatuses) {
  const std::map<std::string, std::string> metadata = {
      {"limit", "64"}, {"requested", "65"}, {"queued", "3"}, {"a", "1"},
      {"b", "2"},      {"c", "3"},          {"d", "4"}};
  const absl::Status first = WithReason(absl::InvalidArgumentError("x: y"),
                                        kReasonRowsOverLimit, metadata);
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(WithReason(absl::InvalidArgumentError("x: y"),
                         kReasonRowsOverLimit, metadata),
              first);
  }
  EXPECT_EQ(SerializeStatusDetails(first), SerializeStatusDetails(first));
}

TEST(StatusDetailsTest, OkStaysOk) {
  EXPECT_TRUE(WithReason(absl::OkStatus(), kReasonQueueFull).ok());
  EXPECT_EQ(SerializeStatusDetails(absl::OkStatus()), "");
}

}  // namespace
}  // namespace detlogp::v1
