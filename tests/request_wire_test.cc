// SplitHiddenData: any cut of a serialized request into chunks gives the
// request's other fields and its rows' bytes as they were; any other form of
// message (fields repeated, no rows, malformed, truncated) is left to
// protobuf's own parse.
#include "server/transport/request_wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::server {
namespace {

using detlogp::v1::LogProbRequest;

LogProbRequest Request(int64_t data_bytes, uint32_t seed) {
  std::mt19937 random(seed);
  LogProbRequest request;
  request.set_request_id("r" + std::to_string(seed));
  request.set_temperature(0.75f);
  request.set_top_k(5);
  request.set_model("policy");
  request.set_model_version(3);
  request.set_return_lse(true);
  request.mutable_hidden()->set_dtype(detlogp::v1::DTYPE_BFLOAT16);
  request.mutable_hidden()->add_shape(data_bytes / 2);
  request.mutable_hidden()->add_shape(1);
  std::string data(data_bytes, '\0');
  for (char& c : data) c = static_cast<char>(random());
  request.mutable_hidden()->set_data(std::move(data));
  for (int64_t i = 0; i < data_bytes / 2; ++i) {
    request.add_target_ids(random() % 100000);
  }
  return request;
}

// `bytes` cut at random points (empty chunks included).
std::vector<absl::string_view> Chunks(absl::string_view bytes, uint32_t seed,
                                      int cuts) {
  std::mt19937 random(seed);
  std::vector<size_t> at = {0, bytes.size()};
  for (int i = 0; i < cuts; ++i) at.push_back(random() % (bytes.size() + 1));
  std::sort(at.begin(), at.end());
  std::vector<absl::string_view> chunks;
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    chunks.push_back(bytes.substr(at[i], at[i + 1] - at[i]));
  }
  return chunks;
}

std::string Joined(const std::vector<absl::string_view>& pieces) {
  std::string joined;
  for (absl::string_view piece : pieces) {
    joined.append(piece.data(), piece.size());
  }
  return joined;
}

TEST(RequestWireTest, AnyCutGivesTheFieldsAndTheRowsBytes) {
  for (int64_t data_bytes : {2, 64, 4096, 100000}) {
    for (int cuts : {0, 1, 7, 300}) {
      const uint32_t seed = static_cast<uint32_t>(data_bytes * 31 + cuts);
      const LogProbRequest request = Request(data_bytes, seed);
      const std::string wire = request.SerializeAsString();
      const auto chunks = Chunks(wire, seed, cuts);
      auto split = SplitHiddenData(chunks);
      ASSERT_TRUE(split.has_value()) << data_bytes << " " << cuts;
      EXPECT_EQ(split->data_bytes, data_bytes);
      EXPECT_EQ(Joined(split->data), request.hidden().data());
      for (absl::string_view piece : split->data) {
        // Views into the chunks, not copies.
        EXPECT_GE(piece.data(), wire.data());
        EXPECT_LE(piece.data() + piece.size(), wire.data() + wire.size());
      }
      LogProbRequest without_data = request;
      without_data.mutable_hidden()->clear_data();
      EXPECT_EQ(split->header.SerializeAsString(),
                without_data.SerializeAsString());
    }
  }
}

TEST(RequestWireTest, UnknownFieldsAndFieldOrderAreKept) {
  LogProbRequest request = Request(64, 7);
  // An unknown field after the others: number 100, a varint.
  std::string wire = request.SerializeAsString();
  wire += std::string("\xa0\x06\x2a", 3);  // field 100, varint 42
  auto split = SplitHiddenData({wire});
  ASSERT_TRUE(split.has_value());
  LogProbRequest whole;
  ASSERT_TRUE(whole.ParseFromString(wire));
  whole.mutable_hidden()->clear_data();
  EXPECT_EQ(split->header.SerializeAsString(), whole.SerializeAsString());
}

TEST(RequestWireTest, OtherFormsAreLeftToProtobuf) {
  const std::string wire = Request(64, 9).SerializeAsString();
  // The hidden field twice (protobuf merges them).
  const std::string twice = wire + wire;
  EXPECT_FALSE(SplitHiddenData({twice}).has_value());
  // No rows in the message (a shared-memory reference, or none).
  LogProbRequest no_data = Request(64, 9);
  no_data.mutable_hidden()->clear_data();
  const std::string without = no_data.SerializeAsString();
  EXPECT_FALSE(SplitHiddenData({without}).has_value());
  // Truncated anywhere, or a wire type protobuf would refuse.
  for (size_t cut = 1; cut < wire.size(); cut += 7) {
    const std::string truncated = wire.substr(0, cut);
    const auto split = SplitHiddenData({truncated});
    LogProbRequest parsed;
    if (split.has_value()) {
      // Only a cut at a field boundary after the rows parses.
      ASSERT_TRUE(parsed.ParseFromString(truncated)) << cut;
    }
  }
  const std::string group("\x0b\x0c", 2);  // a group: start, end
  EXPECT_FALSE(SplitHiddenData({group}).has_value());
}

TEST(RequestWireTest, GarbageNeverReadsOutOfBounds) {
  std::mt19937 random(11);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string bytes(random() % 64, '\0');
    for (char& c : bytes) c = static_cast<char>(random());
    // A well-formed prefix now and then, so deeper states are reached.
    if (trial % 3 == 0) bytes = Request(8, trial).SerializeAsString() + bytes;
    const auto chunks = Chunks(bytes, trial, trial % 5);
    const auto split = SplitHiddenData(chunks);
    if (split.has_value()) {
      EXPECT_LE(split->data_bytes, static_cast<int64_t>(bytes.size()));
    }
  }
}

}  // namespace
}  // namespace detlogp::server
