// FindUploadChunk: any cut of a plain chunk message into pieces gives the
// chunk's bytes where they lie; any other form (a header, a digest, a chunk
// with other fields, a padded length, another tag) is left to protobuf's
// parse; a malformed length is INVALID_ARGUMENT naming `chunk`, and
// protobuf refuses the same bytes.
#include "server/transport/upload_chunk_wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.pb.h"
#include "proto/status_details.h"
#include "tests/upload_wire_bytes.h"

namespace detlogp::server {
namespace {

using detlogp::v1::UploadModelRequest;

std::string Join(const std::vector<absl::string_view>& spans) {
  std::string joined;
  for (absl::string_view span : spans) joined.append(span.data(), span.size());
  return joined;
}

// True when `span` lies inside one of `pieces` (it was not copied).
bool InsideAPiece(absl::string_view span,
                  const std::vector<absl::string_view>& pieces) {
  for (absl::string_view piece : pieces) {
    if (span.data() >= piece.data() &&
        span.data() + span.size() <= piece.data() + piece.size()) {
      return true;
    }
  }
  return false;
}

// The chunk found in `pieces`, checked against `chunk`.
void ExpectChunk(const std::vector<absl::string_view>& pieces,
                 const std::string& chunk) {
  auto found = FindUploadChunk(pieces);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->size, static_cast<int64_t>(chunk.size()));
  EXPECT_EQ(Join((*found)->spans), chunk);
  for (absl::string_view span : (*found)->spans) {
    EXPECT_FALSE(span.empty());
    EXPECT_TRUE(InsideAPiece(span, pieces));
  }
}

void ExpectMalformed(const std::vector<absl::string_view>& pieces) {
  const std::string wire = Join(pieces);
  auto found = FindUploadChunk(pieces);
  ASSERT_FALSE(found.ok()) << absl::CEscape(wire);
  EXPECT_EQ(found.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v1::DetailsOf(found.status()).fields,
            std::vector<std::string>{"chunk"});
  // Protobuf refuses the same bytes.
  UploadModelRequest parsed;
  EXPECT_FALSE(parsed.ParseFromString(wire)) << absl::CEscape(wire);
}

void ExpectParsedWhole(const std::string& wire) {
  auto found = FindUploadChunk({absl::string_view(wire)});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_FALSE(found->has_value()) << absl::CEscape(wire);
}

TEST(UploadChunkWireTest, FindsAChunkOfAnySizeInOnePiece) {
  // Lengths around the varint's byte boundaries.
  for (size_t size : {size_t{0}, size_t{1}, size_t{127}, size_t{128},
                      size_t{16383}, size_t{16384}, size_t{1} << 21}) {
    const std::string chunk = Pattern(size);
    const std::string wire = ChunkMessage(chunk);
    ExpectChunk({wire}, chunk);
  }
}

TEST(UploadChunkWireTest, AnyCutIntoTwoOrThreePiecesGivesTheSameBytes) {
  // 300 bytes: a two-byte length, so cuts fall inside the tag, inside the
  // length and inside the bytes.
  const std::string chunk = Pattern(300);
  const std::string wire = ChunkMessage(chunk);
  const absl::string_view all(wire);
  for (size_t i = 0; i <= wire.size(); ++i) {
    ExpectChunk({all.substr(0, i), all.substr(i)}, chunk);
    for (size_t j = i; j <= std::min(wire.size(), i + 5); ++j) {
      // Empty pieces (i == j, or at either end) are skipped.
      ExpectChunk({all.substr(0, i), all.substr(i, j - i), all.substr(j),
                   absl::string_view()},
                  chunk);
    }
  }
}

TEST(UploadChunkWireTest, OtherMessagesAreLeftToProtobuf) {
  UploadModelRequest header;
  header.mutable_header()->set_model("policy");
  header.mutable_header()->add_shape(16);
  ExpectParsedWhole(header.SerializeAsString());

  UploadModelRequest digest;
  digest.set_weights_sha256(std::string(64, 'a'));
  ExpectParsedWhole(digest.SerializeAsString());

  // No message at all.
  ExpectParsedWhole("");
  EXPECT_FALSE(FindUploadChunk({})->has_value());
  // Field 2 with another wire type (protobuf keeps it as an unknown field).
  ExpectParsedWhole(std::string("\x10\x05", 2));
  // The chunk's tag written in two bytes (0x92 0x00 reads as 0x12).
  ExpectParsedWhole(
      std::string("\x92\x00\x03"
                  "abc",
                  6));
  // Another field first.
  ExpectParsedWhole(digest.SerializeAsString() + ChunkMessage("abc"));
}

TEST(UploadChunkWireTest, AChunkWithOtherFieldsIsLeftToProtobuf) {
  UploadModelRequest digest;
  digest.set_weights_sha256(std::string(64, 'b'));
  // A chunk, then a digest: protobuf's oneof keeps the last (the digest).
  const std::string chunk_then_digest =
      ChunkMessage("abc") + digest.SerializeAsString();
  ExpectParsedWhole(chunk_then_digest);
  UploadModelRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(chunk_then_digest));
  EXPECT_EQ(parsed.part_case(), UploadModelRequest::kWeightsSha256);
  // Two chunks: protobuf keeps the second.
  ExpectParsedWhole(ChunkMessage("abc") + ChunkMessage("de"));
  // A chunk and an unknown field.
  ExpectParsedWhole(ChunkMessage("abc") + std::string("\x78\x01", 2));
}

TEST(UploadChunkWireTest, APaddedLengthIsLeftToProtobuf) {
  // 3 written as 0x83 0x00: valid, but a typed forward writes 0x03.
  const std::string padded(
      "\x12\x83\x00"
      "abc",
      6);
  ExpectParsedWhole(padded);
  UploadModelRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(padded));
  EXPECT_EQ(parsed.chunk(), "abc");
}

TEST(UploadChunkWireTest, TruncatedLengthsAreRefused) {
  ExpectMalformed({"\x12"});
  ExpectMalformed({"\x12\x80"});
  ExpectMalformed({"\x12\xff\xff"});
  // Cut between pieces: the same.
  ExpectMalformed({"\x12", "\x80"});
  ExpectMalformed({"\x12", "", "\xac"});
}

TEST(UploadChunkWireTest, LengthsBeyondTheMessageAreRefused) {
  ExpectMalformed(
      {std::string("\x12\x05"
                   "abc",
                   5)});
  ExpectMalformed({std::string("\x12\x05", 2), "ab", "c"});
  // 300 announced, 299 sent.
  const std::string wire = ChunkMessage(Pattern(300));
  ExpectMalformed({absl::string_view(wire).substr(0, wire.size() - 1)});
  // The largest length a 64-bit varint holds.
  ExpectMalformed(
      {std::string("\x12") + std::string(9, '\xff') + "\x01" + "abc"});
}

TEST(UploadChunkWireTest, OverlongLengthsAreRefused) {
  // Eleven bytes of varint.
  ExpectMalformed(
      {std::string("\x12") + std::string(10, '\x80') + std::string(1, '\0')});
  // Ten bytes whose last sets bits past 63.
  ExpectMalformed({std::string("\x12") + std::string(9, '\x80') + "\x02"});
}

}  // namespace
}  // namespace detlogp::server
