#include "client/project_request.h"

#include <grpcpp/support/slice.h>

#include "detlogp/v1/detlogp.pb.h"
#include "proto/wire_bytes.h"

namespace detlogp::client {
namespace {

constexpr int64_t kIn = 96;

}  // namespace

grpc::ByteBuffer ProjectRequestBytes(const std::vector<RowSpan>& spans,
                                     int64_t rows_per_chunk,
                                     const std::string& request_id) {
  int64_t rows = 0;
  for (const RowSpan& span : spans) rows += span.rows;
  const uint64_t data_bytes = static_cast<uint64_t>(rows * kIn) * sizeof(float);

  detlogp::v1::Tensor x;
  x.set_dtype(detlogp::v1::DTYPE_FLOAT32);
  x.add_shape(rows);
  x.add_shape(kIn);
  std::string x_head = x.SerializeAsString();
  wire::AppendBytesFieldKey(detlogp::v1::Tensor::kDataFieldNumber, &x_head);
  wire::AppendVarint(data_bytes, &x_head);

  detlogp::v1::ProjectRequest request;
  request.set_request_id(request_id);
  request.set_rows_per_chunk(rows_per_chunk);
  std::string head = request.SerializeAsString();
  wire::AppendBytesFieldKey(detlogp::v1::ProjectRequest::kXFieldNumber, &head);
  wire::AppendVarint(x_head.size() + data_bytes, &head);
  head += x_head;

  std::vector<grpc::Slice> slices;
  slices.reserve(spans.size() + 1);
  slices.emplace_back(head);
  for (const RowSpan& span : spans) {
    if (span.rows == 0) continue;
    slices.emplace_back(span.x, static_cast<size_t>(span.rows * kIn) * sizeof(float),
                        grpc::Slice::STATIC_SLICE);
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace detlogp::client
