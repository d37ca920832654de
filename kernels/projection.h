// MiniMax-H3 FP32 video input projection: Y[R, 5376] = X[R, 96] . W^T + b.
//
// The fixed order (the bit contract shared by every path, CPU and CUDA):
// each output element is ONE sequential chain over its 96 terms, in k order,
// each step a fused multiply-add rounded once, then the bias added once:
//     acc = 0.f; for k in 0..95: acc = fmaf(x[k], w[o][k], acc); y = acc + b[o]
// (y = acc when there is no bias; adding +0.f would turn -0 into +0). Nothing
// about an output depends on any other row, the row count, the thread count or
// the device, so the result is batch invariant by construction: permuting
// rows, micro-batching or padding never changes a row's bits. The CPU path
// below uses std::fma in exactly that order; the CUDA path
// (kernels/cuda/projection_cuda.h) is tested bit-equal against it.
#ifndef DETLOGP_KERNELS_PROJECTION_H_
#define DETLOGP_KERNELS_PROJECTION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/parallel_for.h"

namespace detlogp::kernels {

inline constexpr int64_t kProjectionInDim = 96;     // K: features per row.
inline constexpr int64_t kProjectionOutDim = 5376;  // N: outputs per row.
// Only guards int64 size arithmetic (rows * 5376 elements); far above 8M rows.
inline constexpr int64_t kProjectionMaxRows = int64_t{1} << 40;

// CPU forward. Holds its own copy of the weight, transposed to [96][5376] so
// the inner loop walks contiguous outputs (the per-output k order is
// unchanged).
class ProjectionCpu {
 public:
  struct Options {
    absl::Span<const float> weight;  // [5376][96], row-major.
    absl::Span<const float> bias;    // [5376], or empty for no bias.
    int num_threads = 0;             // 0: std::thread::hardware_concurrency().
  };

  static absl::StatusOr<std::unique_ptr<ProjectionCpu>> Create(
      const Options& options);

  // x: [rows][96], y: [rows][5376]. rows may be 0.
  absl::Status Forward(absl::Span<const float> x, int64_t rows,
                       absl::Span<float> y) const;

  bool has_bias() const { return !bias_.empty(); }

 private:
  ProjectionCpu(std::vector<float> weight_t, std::vector<float> bias,
                int num_threads)
      : weight_t_(std::move(weight_t)),
        bias_(std::move(bias)),
        num_threads_(num_threads) {}

  std::vector<float> weight_t_;  // [96][5376]
  std::vector<float> bias_;      // [5376] or empty
  int num_threads_;
};

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_PROJECTION_H_
