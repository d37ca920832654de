#include "client/project_request.h"

#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "detlogp/v1/detlogp.pb.h"
#include "gtest/gtest.h"

namespace detlogp::client {
namespace {

constexpr int64_t kIn = 96;

std::vector<float> Rows(int64_t rows) {
  std::vector<float> x(static_cast<size_t>(rows * kIn));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.5f - 3.0f;
  return x;
}

detlogp::v1::ProjectRequest Parse(grpc::ByteBuffer bytes) {
  detlogp::v1::ProjectRequest request;
  grpc::ProtoBufferReader reader(&bytes);
  EXPECT_TRUE(request.ParseFromZeroCopyStream(&reader));
  return request;
}

// What the bytes must parse as: the request a ProjectRequest proto of the
// same rows would be.
detlogp::v1::ProjectRequest Expected(const std::vector<float>& rows,
                                     int64_t rows_per_chunk, const std::string& id) {
  detlogp::v1::ProjectRequest request;
  request.set_request_id(id);
  request.set_rows_per_chunk(rows_per_chunk);
  request.mutable_x()->set_dtype(detlogp::v1::DTYPE_FLOAT32);
  request.mutable_x()->add_shape(static_cast<int64_t>(rows.size()) / kIn);
  request.mutable_x()->add_shape(kIn);
  request.mutable_x()->set_data(rows.data(), rows.size() * sizeof(float));
  return request;
}

TEST(ProjectRequestBytes, ParsesAsTheRequestOfItsRows) {
  const std::vector<float> x = Rows(300);
  const detlogp::v1::ProjectRequest got =
      Parse(ProjectRequestBytes({RowSpan{x.data(), 300}}, 256, "video-7"));
  EXPECT_EQ(got.SerializeAsString(), Expected(x, 256, "video-7").SerializeAsString());
}

TEST(ProjectRequestBytes, SpansFollowEachOtherInOrder) {
  const std::vector<float> x = Rows(10);
  // Rows 6-8, then 0-1, then none, then 9: an interleaved call's blocks.
  const grpc::ByteBuffer bytes = ProjectRequestBytes(
      {RowSpan{x.data() + 6 * kIn, 3}, RowSpan{x.data(), 2}, RowSpan{x.data(), 0},
       RowSpan{x.data() + 9 * kIn, 1}},
      3, "v/2of4");
  std::vector<float> rows;
  for (int64_t r : {6, 7, 8, 0, 1, 9}) {
    rows.insert(rows.end(), x.begin() + r * kIn, x.begin() + (r + 1) * kIn);
  }
  EXPECT_EQ(Parse(bytes).SerializeAsString(), Expected(rows, 3, "v/2of4").SerializeAsString());
}

TEST(ProjectRequestBytes, EmptyRequestParses) {
  const detlogp::v1::ProjectRequest got = Parse(ProjectRequestBytes({}, 0, ""));
  EXPECT_EQ(got.x().dtype(), detlogp::v1::DTYPE_FLOAT32);
  ASSERT_EQ(got.x().shape_size(), 2);
  EXPECT_EQ(got.x().shape(0), 0);
  EXPECT_TRUE(got.x().data().empty());
}

// X is lent, not copied: every slice after the header points into the rows
// (the second block first here: gRPC joins slices that follow each other in
// memory).
TEST(ProjectRequestBytes, LendsTheRowsInPlace) {
  const std::vector<float> x = Rows(64);
  grpc::ByteBuffer bytes =
      ProjectRequestBytes({RowSpan{x.data() + 32 * kIn, 32}, RowSpan{x.data(), 32}}, 32, "id");
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(bytes.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 3u);
  EXPECT_LT(slices[0].size(), 64u);  // the header
  EXPECT_EQ(static_cast<const void*>(slices[1].begin()),
            static_cast<const void*>(x.data() + 32 * kIn));
  EXPECT_EQ(static_cast<const void*>(slices[2].begin()), static_cast<const void*>(x.data()));
  EXPECT_EQ(slices[1].size() + slices[2].size(), x.size() * sizeof(float));
}

}  // namespace
}  // namespace detlogp::client
