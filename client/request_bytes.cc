#include "client/request_bytes.h"

#include <grpc/slice.h>

#include <cstring>
#include <string>

#include "proto/wire_format.h"

namespace detlogp::client {

grpc::ByteBuffer SerializeWithRows(const detlogp::v1::LogProbRequest& header,
                                   absl::string_view rows) {
  namespace wire = detlogp::v1::wire;
  using wire::AppendVarint;
  using wire::Tag;
  using Tensor = detlogp::v1::Tensor;
  // hidden: dtype, shape (packed) and the head of data, then the rows.
  const Tensor& hidden = header.hidden();
  std::string tensor_head;
  if (hidden.dtype() != 0) {
    AppendVarint(Tag(Tensor::kDtypeFieldNumber, wire::kVarint), &tensor_head);
    AppendVarint(static_cast<uint64_t>(hidden.dtype()), &tensor_head);
  }
  if (hidden.shape_size() > 0) {
    std::string shape;
    for (const int64_t dim : hidden.shape()) {
      AppendVarint(static_cast<uint64_t>(dim), &shape);
    }
    AppendVarint(Tag(Tensor::kShapeFieldNumber, wire::kLengthDelimited),
                 &tensor_head);
    AppendVarint(shape.size(), &tensor_head);
    tensor_head += shape;
  }
  if (!rows.empty()) {
    AppendVarint(Tag(Tensor::kDataFieldNumber, wire::kLengthDelimited),
                 &tensor_head);
    AppendVarint(rows.size(), &tensor_head);
  }
  std::string hidden_head;
  AppendVarint(Tag(detlogp::v1::LogProbRequest::kHiddenFieldNumber,
                   wire::kLengthDelimited),
               &hidden_head);
  AppendVarint(tensor_head.size() + rows.size(), &hidden_head);
  // Every other field as protobuf writes them (a parser takes fields in any
  // order).
  detlogp::v1::LogProbRequest rest = header;
  rest.clear_hidden();
  const size_t rest_bytes = rest.ByteSizeLong();
  const size_t total =
      hidden_head.size() + tensor_head.size() + rows.size() + rest_bytes;
  grpc_slice slice = grpc_slice_malloc(total);
  uint8_t* out = GRPC_SLICE_START_PTR(slice);
  std::memcpy(out, hidden_head.data(), hidden_head.size());
  out += hidden_head.size();
  std::memcpy(out, tensor_head.data(), tensor_head.size());
  out += tensor_head.size();
  if (!rows.empty()) std::memcpy(out, rows.data(), rows.size());
  out += rows.size();
  rest.SerializeWithCachedSizesToArray(out);
  grpc::Slice owned(slice, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&owned, 1);
}

grpc::ByteBuffer SerializeRequest(const detlogp::v1::LogProbRequest& request) {
  grpc_slice slice = grpc_slice_malloc(request.ByteSizeLong());
  request.SerializeWithCachedSizesToArray(GRPC_SLICE_START_PTR(slice));
  grpc::Slice owned(slice, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&owned, 1);
}

}  // namespace detlogp::client
