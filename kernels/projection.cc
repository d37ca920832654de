#include "kernels/projection.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace detlogp::kernels {

absl::StatusOr<std::unique_ptr<ProjectionCpu>> ProjectionCpu::Create(
    const Options& options) {
  constexpr int64_t kWeightSize = kProjectionOutDim * kProjectionInDim;
  if (static_cast<int64_t>(options.weight.size()) != kWeightSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("projection weight must have ", kProjectionOutDim, "x",
                     kProjectionInDim, "=", kWeightSize, " floats, got ",
                     options.weight.size()));
  }
  if (!options.bias.empty() &&
      static_cast<int64_t>(options.bias.size()) != kProjectionOutDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("projection bias must be empty or have ",
                     kProjectionOutDim, " floats, got ", options.bias.size()));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError("num_threads must be >= 0");
  }
  std::vector<float> weight_t(kWeightSize);
  for (int64_t o = 0; o < kProjectionOutDim; ++o) {
    for (int64_t k = 0; k < kProjectionInDim; ++k) {
      weight_t[k * kProjectionOutDim + o] =
          options.weight[o * kProjectionInDim + k];
    }
  }
  std::vector<float> bias(options.bias.begin(), options.bias.end());
  return std::unique_ptr<ProjectionCpu>(new ProjectionCpu(
      std::move(weight_t), std::move(bias), options.num_threads));
}

absl::Status ProjectionCpu::Forward(absl::Span<const float> x, int64_t rows,
                                    absl::Span<float> y) const {
  if (rows < 0 || rows > kProjectionMaxRows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows must be in [0, kProjectionMaxRows=", kProjectionMaxRows,
        "], got ", rows));
  }
  if (static_cast<int64_t>(x.size()) != rows * kProjectionInDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("x must have rows*", kProjectionInDim, "=",
                     rows * kProjectionInDim, " floats, got ", x.size()));
  }
  if (static_cast<int64_t>(y.size()) != rows * kProjectionOutDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("y must have rows*", kProjectionOutDim, "=",
                     rows * kProjectionOutDim, " floats, got ", y.size()));
  }
  const float* wt = weight_t_.data();
  const float* b = bias_.empty() ? nullptr : bias_.data();
  ParallelForRanges(rows, num_threads_, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x.data() + r * kProjectionInDim;
      float* acc = y.data() + r * kProjectionOutDim;  // accumulate in place
      std::fill(acc, acc + kProjectionOutDim, 0.f);
      // k outer, o inner: every output still sees its terms in k order.
      for (int64_t k = 0; k < kProjectionInDim; ++k) {
        const float xk = xr[k];
        const float* wk = wt + k * kProjectionOutDim;
        for (int64_t o = 0; o < kProjectionOutDim; ++o) {
          acc[o] = std::fma(xk, wk[o], acc[o]);
        }
      }
      if (b != nullptr) {
        for (int64_t o = 0; o < kProjectionOutDim; ++o) acc[o] = acc[o] + b[o];
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace detlogp::kernels
