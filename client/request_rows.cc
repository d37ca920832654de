#include "client/request_rows.h"

#include <algorithm>

#include "proto/dtype_bytes.h"

namespace detlogp::client {

int64_t RowBytes(const detlogp::v1::LogProbRequest& request) {
  const detlogp::v1::Tensor& hidden = request.hidden();
  if (hidden.shape_size() != 2 || hidden.shape(1) <= 0 ||
      hidden.shape(0) != request.target_ids_size()) {
    return 0;
  }
  return hidden.shape(1) * detlogp::v1::DTypeBytes(hidden.dtype());
}

detlogp::v1::LogProbRequest WithoutRows(
    const detlogp::v1::LogProbRequest& request) {
  detlogp::v1::LogProbRequest copy;
  copy.set_request_id(request.request_id());
  copy.mutable_hidden()->set_dtype(request.hidden().dtype());
  copy.set_temperature(request.temperature());
  copy.set_return_lse(request.return_lse());
  copy.set_model(request.model());
  copy.set_model_version(request.model_version());
  copy.set_return_entropy(request.return_entropy());
  copy.set_top_k(request.top_k());
  copy.set_return_timing(request.return_timing());
  return copy;
}

detlogp::v1::LogProbRequest WithoutHiddenBytes(
    const detlogp::v1::LogProbRequest& request) {
  detlogp::v1::LogProbRequest copy = WithoutRows(request);
  *copy.mutable_hidden()->mutable_shape() = request.hidden().shape();
  *copy.mutable_target_ids() = request.target_ids();
  return copy;
}

RowSlices CutRows(const detlogp::v1::LogProbRequest& request,
                  int64_t rows_per_request, absl::string_view bytes) {
  const int64_t rows = request.target_ids_size();
  const int64_t row_bytes = RowBytes(request);
  const char* const data = bytes.data();
  RowSlices slices;
  for (int64_t begin = 0; begin < rows; begin += rows_per_request) {
    const int64_t count = std::min(rows_per_request, rows - begin);
    // Each header gets its own targets only (not the call's, cleared).
    slices.headers.push_back(WithoutRows(request));
    detlogp::v1::LogProbRequest& header = slices.headers.back();
    header.mutable_hidden()->add_shape(count);
    header.mutable_hidden()->add_shape(request.hidden().shape(1));
    header.mutable_target_ids()->Add(
        request.target_ids().begin() + begin,
        request.target_ids().begin() + begin + count);
    slices.rows.emplace_back(data + begin * row_bytes, count * row_bytes);
  }
  return slices;
}

}  // namespace detlogp::client
