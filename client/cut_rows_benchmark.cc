// Cutting a large call into requests before any is sent: CutRows, which
// gives each request's header its own targets, against headers copied
// whole from the call and then trimmed (the call's targets copied once per
// request). Rows per call and per request as on a GPU host at H = 4096
// (1,024 rows, 8 MiB, a request); the rows' bytes are only viewed.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "client/request_rows.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::client {
namespace {

constexpr int64_t kHidden = 8;  // the cut never reads the rows' bytes
constexpr int64_t kRowsPerRequest = 1024;

detlogp::v1::LogProbRequest Call(int64_t rows) {
  detlogp::v1::LogProbRequest call;
  call.set_model("default");
  call.mutable_hidden()->set_dtype(detlogp::v1::DTYPE_BFLOAT16);
  call.mutable_hidden()->add_shape(rows);
  call.mutable_hidden()->add_shape(kHidden);
  for (int64_t i = 0; i < rows; ++i) call.add_target_ids((i * 7919) % 151936);
  return call;
}

void BM_CutRows(benchmark::State& state) {
  const detlogp::v1::LogProbRequest call = Call(state.range(0));
  const std::string rows(state.range(0) * kHidden * 2, '\0');
  for (auto _ : state) {
    RowSlices slices = CutRows(call, kRowsPerRequest, rows);
    benchmark::DoNotOptimize(slices);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// Rejected: each header copied whole, the call's targets cleared after.
void BM_HeadersCopiedWhole(benchmark::State& state) {
  const detlogp::v1::LogProbRequest call = Call(state.range(0));
  const int64_t rows = state.range(0);
  for (auto _ : state) {
    std::vector<detlogp::v1::LogProbRequest> headers;
    for (int64_t begin = 0; begin < rows; begin += kRowsPerRequest) {
      const int64_t count = std::min(kRowsPerRequest, rows - begin);
      headers.push_back(WithoutHiddenBytes(call));
      detlogp::v1::LogProbRequest& header = headers.back();
      header.mutable_hidden()->set_shape(0, count);
      header.mutable_target_ids()->Clear();
      header.mutable_target_ids()->Add(
          call.target_ids().begin() + begin,
          call.target_ids().begin() + begin + count);
    }
    benchmark::DoNotOptimize(headers);
  }
  state.SetItemsProcessed(state.iterations() * rows);
}

BENCHMARK(BM_CutRows)
    ->Arg(16384)
    ->Arg(262144)
    ->Arg(1048576)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_HeadersCopiedWhole)
    ->Arg(16384)
    ->Arg(262144)
    ->Arg(1048576)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace detlogp::client
