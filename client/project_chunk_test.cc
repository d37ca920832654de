// ParseProjectChunk against protobuf's own encoding of ProjectResponse, cut
// into slices everywhere, and against hand-broken messages.
#include "client/project_chunk.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace detlogp::client {
namespace {

using detlogp::v1::ProjectResponse;

ProjectResponse Response(int64_t rows, int64_t out_dim) {
  ProjectResponse response;
  response.set_request_id("video-7");
  response.set_row_offset(4096);
  response.mutable_y()->set_dtype(detlogp::v1::DTYPE_FLOAT32);
  response.mutable_y()->add_shape(rows);
  response.mutable_y()->add_shape(out_dim);
  std::string data(rows * out_dim * 4, '\0');
  for (size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<char>(i * 7 + 1);
  response.mutable_y()->set_data(data);
  response.set_determinism_key("key-abc");
  return response;
}

// `bytes` as a ByteBuffer of slices cut at `cuts` (ascending offsets).
grpc::ByteBuffer Cut(const std::string& bytes,
                     const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + from, cut - from);
    from = cut;
  }
  slices.emplace_back(bytes.data() + from, bytes.size() - from);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Joined(const ProjectChunk& chunk) {
  std::string out(chunk.y_data_bytes, '\0');
  chunk.CopyYTo(out.data());
  return out;
}

void ExpectSame(const ProjectChunk& chunk, const ProjectResponse& want) {
  EXPECT_EQ(chunk.request_id, want.request_id());
  EXPECT_EQ(chunk.row_offset, want.row_offset());
  EXPECT_EQ(chunk.y_dtype, want.y().dtype());
  EXPECT_EQ(chunk.y_shape, std::vector<int64_t>(want.y().shape().begin(),
                                                want.y().shape().end()));
  EXPECT_EQ(chunk.y_data_bytes, static_cast<int64_t>(want.y().data().size()));
  EXPECT_EQ(Joined(chunk), want.y().data());
  EXPECT_EQ(chunk.determinism_key, want.determinism_key());
}

TEST(ProjectChunkTest, ParsesEveryTwoWayAndThreeWayCut) {
  const ProjectResponse response = Response(3, 5);
  const std::string bytes = response.SerializeAsString();
  for (size_t a = 0; a <= bytes.size(); ++a) {
    for (size_t b = a; b <= bytes.size(); b += 3) {
      absl::StatusOr<ProjectChunk> chunk =
          ParseProjectChunk(Cut(bytes, {a, b}));
      ASSERT_TRUE(chunk.ok()) << a << " " << b << ": " << chunk.status();
      ExpectSame(*chunk, response);
    }
  }
}

TEST(ProjectChunkTest, YDataIsViewedNotCopiedAndSurvivesMoves) {
  const ProjectResponse response = Response(64, 100);  // 25,600 bytes of y
  const std::string bytes = response.SerializeAsString();
  grpc::ByteBuffer buffer = Cut(bytes, {10, 5000, 20000});
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(buffer.Dump(&slices).ok());
  absl::StatusOr<ProjectChunk> parsed = ParseProjectChunk(std::move(slices));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ProjectChunk chunk = *std::move(parsed);
  ASSERT_EQ(chunk.y_data.size(), 3u);  // pieces of the last three slices
  for (absl::string_view piece : chunk.y_data) {
    bool inside = false;
    for (const grpc::Slice& s : chunk.slices) {
      const char* begin = reinterpret_cast<const char*>(s.begin());
      inside |= piece.data() >= begin &&
                piece.data() + piece.size() <= begin + s.size();
    }
    EXPECT_TRUE(inside);
  }
  ProjectChunk moved = std::move(chunk);
  ExpectSame(moved, response);
  const ProjectResponse again = moved.ToProto();
  EXPECT_EQ(again.SerializeAsString(), bytes);
}

TEST(ProjectChunkTest, AnyValidEncodingParses) {
  // Fields in reverse order, an unknown field of each wire type, shape
  // unpacked, y given twice (merged: shape appended, data replaced).
  ProjectResponse want = Response(2, 3);
  std::string y_first;
  {
    detlogp::v1::Tensor y;
    y.add_shape(2);
    y.set_data("stale");
    y_first = y.SerializeAsString();
  }
  std::string y_second;
  y_second += '\x1a';  // data (3, LEN)
  y_second += static_cast<char>(want.y().data().size());
  y_second += want.y().data();
  y_second += '\x10';  // shape (2, VARINT), unpacked
  y_second += '\x03';
  y_second += '\x08';  // dtype
  y_second += '\x01';
  y_second += "\x2d\x01\x02\x03\x04";  // unknown field 5, fixed32
  std::string bytes;
  bytes += "\x22\x07key-abc";                       // determinism_key
  bytes += "\x39\x01\x02\x03\x04\x05\x06\x07\x08";  // unknown field 7, fixed64
  bytes += '\x1a';
  bytes += static_cast<char>(y_first.size());
  bytes += y_first;
  bytes += "\x40\x96\x01";  // unknown field 8, varint
  bytes += "\x4a\x03xyz";   // unknown field 9, LEN
  bytes += '\x1a';
  bytes += static_cast<char>(y_second.size());
  bytes += y_second;
  bytes += "\x10\x80\x20";     // row_offset 4096
  bytes += "\x0a\x07video-7";  // request_id
  ProjectResponse reference;
  ASSERT_TRUE(reference.ParseFromString(bytes));
  reference.DiscardUnknownFields();
  ASSERT_EQ(reference.SerializeAsString(), want.SerializeAsString());
  absl::StatusOr<ProjectChunk> chunk = ParseProjectChunk(Cut(bytes, {5, 17}));
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  ExpectSame(*chunk, want);
}

TEST(ProjectChunkTest, AnEmptyMessageIsAllDefaults) {
  absl::StatusOr<ProjectChunk> chunk = ParseProjectChunk(Cut("", {}));
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->row_offset, 0);
  EXPECT_TRUE(chunk->y_shape.empty());
  EXPECT_EQ(chunk->y_data_bytes, 0);
}

// The status of parsing `bytes`, expected DATA_LOSS starting with `field`.
void ExpectMalformed(const std::string& bytes, absl::string_view field) {
  SCOPED_TRACE(field);
  absl::StatusOr<ProjectChunk> chunk =
      ParseProjectChunk(Cut(bytes, {bytes.size() / 2}));
  ASSERT_FALSE(chunk.ok());
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StartsWith(chunk.status().message(), field))
      << chunk.status();
}

TEST(ProjectChunkTest, MalformedMessagesNameTheField) {
  const std::string good = Response(2, 3).SerializeAsString();
  // Cut short inside y.data: y's length and data's length both run past the
  // end; y's is checked first.
  ExpectMalformed(good.substr(0, good.size() - 20), "ProjectResponse.y:");
  // y.data's length larger than y itself.
  {
    std::string y = "\x08\x01\x1a\x10" + std::string(4, 'a');
    ExpectMalformed("\x1a" + std::string(1, static_cast<char>(y.size())) + y,
                    "ProjectResponse.y.data: length 16 runs past");
  }
  ExpectMalformed(
      std::string("\x15\x00\x00\x00\x00", 5),  // row_offset as fixed32
      "ProjectResponse.row_offset: wire type 5");
  ExpectMalformed("\x10\x80\x80",
                  "ProjectResponse.row_offset: a varint runs past");
  ExpectMalformed("\x10" + std::string(10, '\xff') + "\x01",
                  "ProjectResponse.row_offset: a varint longer than 10 bytes");
  ExpectMalformed("\x0a\x09short", "ProjectResponse.request_id: length 9");
  ExpectMalformed("\x22\x09short", "ProjectResponse.determinism_key: length 9");
  ExpectMalformed("\x1a\x03\x12\x05\x01", "ProjectResponse.y.shape: length 5");
  ExpectMalformed("\x1a\x02\x08\x80",
                  "ProjectResponse.y.dtype: a varint runs past");
  ExpectMalformed(std::string("\x1a\x02\x1d\x00", 4),
                  "ProjectResponse.y.data: wire type 5");
  ExpectMalformed("\x3b\x01",
                  "ProjectResponse field 7: unsupported wire type 3");
  ExpectMalformed("\x3d\x01", "ProjectResponse field 7: runs past");
  ExpectMalformed(std::string("\x00\x01", 2),
                  "ProjectResponse: field number 0");
}

}  // namespace
}  // namespace detlogp::client
