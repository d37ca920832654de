#include "server/transport/request_validation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "kernels/bfloat16.h"
#include "tests/truncatable_shm.h"

namespace detlogp::server {
namespace {

using detlogp::v1::LogProbRequest;

constexpr int64_t kH = 8;
const RequestLimits kLimits{kH, 100, 16, 20};

LogProbRequest ValidRequest(int64_t rows) {
  LogProbRequest request;
  request.mutable_hidden()->set_dtype(detlogp::v1::DTYPE_FLOAT32);
  request.mutable_hidden()->add_shape(rows);
  request.mutable_hidden()->add_shape(kH);
  std::string data(rows * kH * 4, '\0');
  for (int64_t i = 0; i < rows * kH; ++i) {
    const float value = 0.25f * static_cast<float>(i + 1);
    std::memcpy(&data[4 * i], &value, 4);
  }
  request.mutable_hidden()->set_data(data);
  for (int64_t r = 0; r < rows; ++r) request.add_target_ids(r);
  return request;
}

void ExpectInvalid(const LogProbRequest& request, const std::string& field) {
  auto result = ValidateLogProbRequest(request, kLimits);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find(field), std::string::npos)
      << result.status().message() << " does not name " << field;
}

TEST(RequestValidationTest, AcceptsEachDtypeAndConvertsToBf16) {
  auto rows = ValidateLogProbRequest(ValidRequest(3), kLimits);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->rows, 3);
  EXPECT_EQ(rows->temperature, 1.0f);  // 0 means 1
  EXPECT_EQ(rows->converted[0], kernels::FloatToBf16(0.25f));
  uint16_t first;
  std::memcpy(&first, rows->hidden_bf16, 2);
  EXPECT_EQ(first, kernels::FloatToBf16(0.25f));

  LogProbRequest half = ValidRequest(1);
  half.mutable_hidden()->set_dtype(detlogp::v1::DTYPE_FLOAT16);
  half.mutable_hidden()->set_data(std::string(kH * 2, '\x3c'));  // 0x3c3c
  EXPECT_TRUE(ValidateLogProbRequest(half, kLimits).ok());
  half.mutable_hidden()->set_dtype(detlogp::v1::DTYPE_BFLOAT16);
  EXPECT_TRUE(ValidateLogProbRequest(half, kLimits).ok());
}

TEST(RequestValidationTest, RoundsFloatToNearestEven) {
  // 1 + 2^-8 lies exactly between two bf16 values: ties go to even (1.0).
  EXPECT_EQ(kernels::FloatToBf16(1.00390625f), 0x3f80);
  // 1 + 3 * 2^-8 ties between 0x3f81 and 0x3f82: even is 0x3f82.
  EXPECT_EQ(kernels::FloatToBf16(1.01171875f), 0x3f82);
}

TEST(RequestValidationTest, NamesTheFieldOfEveryBadInput) {
  LogProbRequest request = ValidRequest(2);
  request.mutable_hidden()->add_shape(1);
  ExpectInvalid(request, "hidden.shape");

  request = ValidRequest(2);
  request.mutable_hidden()->set_shape(1, kH + 1);
  ExpectInvalid(request, "hidden.shape[1]");

  request = ValidRequest(2);
  request.mutable_hidden()->mutable_data()->pop_back();
  ExpectInvalid(request, "hidden.data");

  request = ValidRequest(2);
  request.mutable_hidden()->set_dtype(detlogp::v1::DTYPE_UNSPECIFIED);
  ExpectInvalid(request, "hidden.dtype");

  request = ValidRequest(2);
  request.mutable_hidden()->set_dtype(static_cast<detlogp::v1::DType>(42));
  ExpectInvalid(request, "hidden.dtype");

  request = ValidRequest(2);
  request.add_target_ids(1);
  ExpectInvalid(request, "target_ids");

  for (int64_t bad : {int64_t{-1}, int64_t{100}, int64_t{1} << 40}) {
    request = ValidRequest(2);
    request.set_target_ids(1, bad);
    ExpectInvalid(request, "target_ids[1]");
  }

  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), -1.0f}) {
    request = ValidRequest(2);
    request.set_temperature(bad);
    ExpectInvalid(request, "temperature");
  }

  ExpectInvalid(ValidRequest(17), "max_request_rows");

  request = ValidRequest(2);
  request.mutable_hidden()->set_shape(0, -1);
  ExpectInvalid(request, "hidden.shape[0]");
}

TEST(RequestValidationTest, TopKWithinTheServerAndVocabularyLimits) {
  LogProbRequest request = ValidRequest(2);
  request.set_return_entropy(true);
  request.set_top_k(20);
  auto rows = ValidateLogProbRequest(request, kLimits);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_TRUE(rows->return_entropy);
  EXPECT_EQ(rows->top_k, 20);

  for (int64_t bad : {int64_t{-1}, int64_t{-(int64_t{1} << 40)}}) {
    request.set_top_k(bad);
    ExpectInvalid(request, "top_k");
    ExpectInvalid(request, "negative");
  }
  for (int64_t bad : {int64_t{21}, int64_t{1} << 40}) {
    request.set_top_k(bad);
    ExpectInvalid(request, "top_k");
    ExpectInvalid(request, "--max_top_k");
    ExpectInvalid(request, "20");
  }
  // A server limit above the vocabulary: the vocabulary bounds it.
  const RequestLimits small_vocab{kH, 10, 16, 20};
  request.set_top_k(11);
  auto refused = ValidateLogProbRequest(request, small_vocab);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("top_k"), std::string::npos);
  EXPECT_NE(refused.status().message().find("vocab_size=10"),
            std::string::npos);
  for (int64_t r = 0; r < 2; ++r) request.set_target_ids(r, 0);
  request.set_top_k(10);
  EXPECT_TRUE(ValidateLogProbRequest(request, small_vocab).ok());
}

// A backend without entropy/top-k (the portable CUDA kernel): such requests
// are refused with FAILED_PRECONDITION naming the field, plain ones pass.
TEST(RequestValidationTest, ExtrasRefusedWhenTheBackendLacksThem) {
  RequestLimits no_extras = kLimits;
  no_extras.extras_unavailable = "kernel portable-mma-sync-v1 has none";
  LogProbRequest request = ValidRequest(2);
  EXPECT_TRUE(ValidateLogProbRequest(request, no_extras).ok());
  request.set_return_entropy(true);
  auto entropy = ValidateLogProbRequest(request, no_extras);
  ASSERT_FALSE(entropy.ok());
  EXPECT_EQ(entropy.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(entropy.status().message().find("return_entropy"),
            std::string::npos);
  EXPECT_NE(entropy.status().message().find("portable-mma-sync-v1"),
            std::string::npos);
  request.set_return_entropy(false);
  request.set_top_k(3);
  auto top_k = ValidateLogProbRequest(request, no_extras);
  ASSERT_FALSE(top_k.ok());
  EXPECT_EQ(top_k.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(top_k.status().message().find("top_k"), std::string::npos);
}

TEST(RequestValidationTest, EmptyRequestIsValid) {
  auto rows = ValidateLogProbRequest(ValidRequest(0), kLimits);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(rows->rows, 0);
}

// The request's fp32 rows moved into `region` (host memory of the test),
// named by reference.
LogProbRequest InRegion(LogProbRequest request, std::string* region) {
  *region = request.hidden().data();
  request.mutable_hidden()->clear_data();
  detlogp::v1::SharedMemoryRef* ref =
      request.mutable_hidden()->mutable_shared_memory();
  ref->set_region("r");
  ref->set_byte_size(static_cast<int64_t>(region->size()));
  return request;
}

TEST(RequestValidationTest, SharedMemoryRowsReadLikeMessageRows) {
  std::string region;
  const LogProbRequest request = InRegion(ValidRequest(3), &region);
  auto hold = std::make_shared<int>(0);
  int resolved = 0;
  const SharedMemoryResolver resolve =
      [&](const detlogp::v1::SharedMemoryRef& ref)
      -> absl::StatusOr<SharedMemoryBytes> {
    ++resolved;
    EXPECT_EQ(ref.region(), "r");
    SharedMemoryBytes bytes;
    bytes.data = region.data();
    bytes.location.kind = HiddenLocation::Kind::kPinnedHost;
    bytes.hold = hold;
    return bytes;
  };
  auto by_reference = ValidateLogProbRequest(request, kLimits, resolve);
  ASSERT_TRUE(by_reference.ok()) << by_reference.status();
  auto in_message = ValidateLogProbRequest(ValidRequest(3), kLimits);
  ASSERT_TRUE(in_message.ok());
  EXPECT_EQ(resolved, 1);
  EXPECT_EQ(by_reference->converted, in_message->converted);
  EXPECT_EQ(by_reference->source, ValidatedRows::Source::kSystemRegion);
  EXPECT_EQ(by_reference->hidden_bytes, 3 * kH * 4);
  // Converted rows are the server's own: the region is let go at once.
  EXPECT_EQ(by_reference->region_hold, nullptr);
  EXPECT_EQ(by_reference->location.kind, HiddenLocation::Kind::kHost);
  EXPECT_EQ(hold.use_count(), 1);
}

TEST(RequestValidationTest, BadSharedMemoryReferencesNameTheirField) {
  std::string region;
  const LogProbRequest good = InRegion(ValidRequest(2), &region);
  const SharedMemoryResolver not_found = [](const detlogp::v1::SharedMemoryRef&)
      -> absl::StatusOr<SharedMemoryBytes> {
    return absl::NotFoundError("hidden.shared_memory.region: no region");
  };
  auto absent = ValidateLogProbRequest(good, kLimits, not_found);
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  auto off = ValidateLogProbRequest(good, kLimits);
  EXPECT_EQ(off.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(off.status().message().rfind("hidden.shared_memory:", 0), 0u)
      << off.status();
  LogProbRequest both = good;
  both.mutable_hidden()->set_data("x");
  auto both_result = ValidateLogProbRequest(both, kLimits, not_found);
  EXPECT_EQ(both_result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(both_result.status().message().rfind("hidden.data:", 0), 0u);
  LogProbRequest wrong_size = good;
  wrong_size.mutable_hidden()->mutable_shared_memory()->set_byte_size(4);
  auto size_result = ValidateLogProbRequest(wrong_size, kLimits, not_found);
  EXPECT_EQ(size_result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(size_result.status().message().rfind(
                "hidden.shared_memory.byte_size:", 0),
            0u);
  // A CUDA region must hold bf16: the server converts on the host only.
  const SharedMemoryResolver on_device =
      [&](const detlogp::v1::SharedMemoryRef&)
      -> absl::StatusOr<SharedMemoryBytes> {
    SharedMemoryBytes bytes;
    bytes.data = region.data();
    bytes.location.kind = HiddenLocation::Kind::kDevice;
    bytes.location.device = 0;
    return bytes;
  };
  auto fp32_on_device = ValidateLogProbRequest(good, kLimits, on_device);
  EXPECT_EQ(fp32_on_device.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fp32_on_device.status().message().rfind("hidden.dtype:", 0), 0u);
}

// fp32 rows in a system region are decoded here, from the mapping; a
// region its owner truncated is refused naming the field and the region,
// and bf16 rows (not read here) pass on with the location that tells the
// batcher to read them through the guard.
TEST(RequestValidationTest, ARegionTruncatedByItsOwnerIsRefusedNotACrash) {
  using detlogp::testing::TruncatableShm;
  auto shm = TruncatableShm::Create(2);
  ASSERT_NE(shm, nullptr);
  std::string rows;
  LogProbRequest request = InRegion(ValidRequest(3), &rows);
  std::memcpy(shm->page(1), rows.data(), rows.size());
  const SharedMemoryResolver resolve = [&](const detlogp::v1::SharedMemoryRef&)
      -> absl::StatusOr<SharedMemoryBytes> {
    SharedMemoryBytes bytes;
    bytes.data = shm->page(1);
    bytes.location.owner_may_truncate = true;
    bytes.location.region = "r";
    return bytes;
  };
  auto intact = ValidateLogProbRequest(request, kLimits, resolve);
  ASSERT_TRUE(intact.ok()) << intact.status();
  auto in_message = ValidateLogProbRequest(ValidRequest(3), kLimits);
  ASSERT_TRUE(in_message.ok());
  EXPECT_EQ(intact->converted, in_message->converted);
  EXPECT_FALSE(intact->location.owner_may_truncate);  // the server's copy

  ASSERT_TRUE(shm->TruncateToPages(1));
  auto shrunk = ValidateLogProbRequest(request, kLimits, resolve);
  EXPECT_EQ(shrunk.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      shrunk.status().message().rfind("hidden.shared_memory: region \"r\"", 0),
      0u)
      << shrunk.status();

  LogProbRequest bf16 = request;
  bf16.mutable_hidden()->set_dtype(detlogp::v1::DTYPE_BFLOAT16);
  bf16.mutable_hidden()->mutable_shared_memory()->set_byte_size(3 * kH * 2);
  auto passed_on = ValidateLogProbRequest(bf16, kLimits, resolve);
  ASSERT_TRUE(passed_on.ok()) << passed_on.status();
  EXPECT_EQ(passed_on->hidden_bf16, shm->page(1));
  EXPECT_TRUE(passed_on->location.owner_may_truncate);
  EXPECT_EQ(passed_on->location.region, "r");
}

}  // namespace
}  // namespace detlogp::server
