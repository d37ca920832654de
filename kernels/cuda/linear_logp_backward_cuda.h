// The batch-invariant backward of linear-logp on Hopper (design and counts
// in docs/kernels.md, "Fused backward"): dhidden, dweight and dbias of
//   logp = z[target] - lse, lse, entropy  for  z = (hidden · Wᵀ + b) / T,
// recomputing the logits chunk by chunk from the forward's saved lse, never
// storing [rows, V]. dhidden of a row depends only on that row and its
// upstream gradients; dweight and dbias are the same bits run to run.
//
// Called by the trainer ops (kernels/capi/detlogp_ops_cuda.h,
// detlogp_cuda_linear_logp_backward), which detlogp.torch uses as
// linear_logp's backward on compute capability 9.0. Tested on the GPU by
// tests/cuda/linear_logp_backward_test.cu; measured in docs/performance.md,
// "Fused linear-logp backward".
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_BACKWARD_CUDA_H_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_BACKWARD_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/linear_logp_cuda.h"

namespace detlogp::kernels::cuda {

enum class GradDtype { kFloat32, kBfloat16 };

// Device pointers for one backward call. Per-row inputs are [rows]; an
// upstream gradient left null counts as zero.
struct LinearLogpGradView {
  const __nv_bfloat16* hidden = nullptr;  // [rows, hidden_size], 16-B aligned
  int64_t rows = 0;
  const int32_t* targets = nullptr;     // or targets64 (needed with
  const int64_t* targets64 = nullptr;   // grad_logprobs)
  const float* temperatures = nullptr;  // or null: temperature
  float temperature = 1.0f;
  const float* lse = nullptr;      // the forward's, required
  const float* entropy = nullptr;  // the forward's (with grad_entropy)
  const float* grad_logprobs = nullptr;
  const float* grad_lse = nullptr;
  const float* grad_entropy = nullptr;
  // Outputs, each optional (at least one). grad_hidden [rows, hidden_size];
  // grad_weight [padded_vocab_size, hidden_size] (rows >= V get zeros);
  // grad_bias [padded_vocab_size] fp32. 16-byte aligned.
  void* grad_hidden = nullptr;
  GradDtype grad_hidden_dtype = GradDtype::kFloat32;
  void* grad_weight = nullptr;
  GradDtype grad_weight_dtype = GradDtype::kFloat32;
  float* grad_bias = nullptr;
};

class LinearLogpBackwardCuda {
 public:
  struct Options {
    LinearLogpWeightsView weights;
    int device = 0;
  };

  // Rows handled in one pass; larger batches run in passes of this many
  // rows (dweight and dbias then accumulate across passes in fp32, so a
  // bf16 grad_weight needs rows <= kMaxRowsPerPass).
  static constexpr int64_t kMaxRowsPerPass = 16384;

  // Validates the weights and the device (compute capability 9.0); builds
  // the weight's tensor maps.
  static absl::StatusOr<std::unique_ptr<LinearLogpBackwardCuda>> Create(
      const Options& options);

  ~LinearLogpBackwardCuda();

  static const char* KernelVersion();

  // Device workspace Launch needs for `grads` (its rows and outputs).
  size_t WorkspaceBytes(const LinearLogpGradView& grads) const;
  // The same from what it depends on: the rows, whether dhidden is asked
  // for in bf16 (an fp32 accumulator) and whether dbias is asked for.
  size_t WorkspaceBytes(int64_t rows, bool bf16_grad_hidden,
                        bool grad_bias) const;

  // Enqueues the backward on `stream`. Everything is checked before the
  // first launch: an error status leaves the outputs untouched.
  absl::Status Launch(const LinearLogpGradView& grads, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) const;

 private:
  struct Impl;
  LinearLogpBackwardCuda(const Options& options, std::unique_ptr<Impl> impl);

  absl::Status Validate(const LinearLogpGradView& grads, const void* workspace,
                        size_t workspace_bytes) const;

  Options options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detlogp::kernels::cuda

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_BACKWARD_CUDA_H_
