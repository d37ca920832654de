// CUDA path of the H3 video input projection: forward, dX, and dW + dbias.
//
// Same fixed order and so the same bits as the CPU path (kernels/projection.h
// and kernels/projection_grad.h); tests/cuda/projection_cuda_test.cu checks
// that with memcmp for every forward variant, dX, dW and dbias. Create()
// copies the weight (and keeps a transposed copy for the forward SGEMM), so
// re-create after a weight update; the caller's buffers may be freed after
// Create returns. With Options::wrap (the trainer-side ops, kernels/capi)
// it copies nothing and reads the caller's buffers at each launch instead.
// Methods only launch work; they are safe to call from several threads on
// different streams (no mutable state after Create).
#ifndef DETLOGP_KERNELS_CUDA_PROJECTION_CUDA_H_
#define DETLOGP_KERNELS_CUDA_PROJECTION_CUDA_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace detlogp::kernels {

class ProjectionCuda {
 public:
  // Forward kernel variants; all give identical bits, they differ in speed.
  enum class ForwardVariant {
    kDefault,         // per call: kWide from 8192 rows, else kSingleStage
    kSingleStage,     // 2 CTAs/SM, load then compute
    kDoubleBuffered,  // 1 persistent CTA/SM, next tile loads during compute
    kSplitLoad,       // 2 CTAs/SM, first k-half computes while second lands
    kWide,            // 128x256 tiles, weight tile resident, 1 CTA/SM
  };

  struct Options {
    const float* weight = nullptr;  // device, [5376][96]
    const float* bias = nullptr;    // device, [5376], or null for no bias
    int device = 0;
    ForwardVariant variant = ForwardVariant::kDefault;
    // Wrap the caller's device buffers instead of copying them: Create then
    // allocates, copies and synchronizes nothing, and every launch reads
    // weight, weight_t and bias where the caller keeps them (they must hold
    // their values when the launched work runs, and outlive the object).
    bool wrap = false;
    // With wrap: the weight's transpose [96][5376] (LaunchTransposeWeight),
    // read by Forward only; null when only InputGrad/WeightGrad are called.
    const float* weight_t = nullptr;
  };

  static absl::StatusOr<std::unique_ptr<ProjectionCuda>> Create(
      const Options& options);
  ~ProjectionCuda();
  ProjectionCuda(const ProjectionCuda&) = delete;
  ProjectionCuda& operator=(const ProjectionCuda&) = delete;

  // y[rows][5376] = x[rows][96] . W^T (+ bias). Device pointers, 16-byte
  // aligned; asynchronous on `stream`.
  absl::Status Forward(const float* x, int64_t rows, float* y,
                       cudaStream_t stream) const;

  // dx[rows][96] = dy[rows][5376] . W, in kernels/projection_grad.h's order.
  // Without a workspace: one CTA per 128 rows walks all 42 chunks. With one
  // of InputGradWorkspaceBytes(rows) bytes (16-byte aligned; 0 above 8192
  // rows, where workspace is ignored): the 42 chunk partials are computed in
  // parallel into it and folded in chunk order, much faster for small
  // batches. Same bits either way.
  absl::Status InputGrad(const float* dy, int64_t rows, float* dx,
                         cudaStream_t stream) const;
  static int64_t InputGradWorkspaceBytes(int64_t rows);
  absl::Status InputGrad(const float* dy, int64_t rows, float* dx,
                         void* workspace, int64_t workspace_bytes,
                         cudaStream_t stream) const;

  // dweight[5376][96] and dbias[5376] (dbias may be null) for a batch whose
  // row i has logical key first_key + i, in kernels/projection_grad.h's keyed
  // order: bit-equal to ComputeProjectionWeightGrads with those keys. One
  // whole batch per call (for micro-batches in other splits use the CPU
  // ProjectionGradAccumulator). `workspace` must hold
  // WeightGradWorkspaceBytes(rows, first_key) bytes, 16-byte aligned (0, and
  // workspace may be null, when the keys lie in one 4096-key superchunk).
  static int64_t WeightGradWorkspaceBytes(int64_t rows, int64_t first_key);
  absl::Status WeightGrad(const float* dy, const float* x, int64_t rows,
                          int64_t first_key, float* dweight, float* dbias,
                          void* workspace, int64_t workspace_bytes,
                          cudaStream_t stream) const;

  // weight_t[96][5376] = transpose of weight[5376][96] (device pointers), on
  // `stream` of `device`: what Options::weight_t holds for a wrapped object.
  static absl::Status LaunchTransposeWeight(const float* weight,
                                            float* weight_t, int device,
                                            cudaStream_t stream);

  // Identifies the default forward kernel (changes when its code does).
  static const char* KernelVersion();
  // Identifies the dX and dW/dbias kernels (changes when their code does).
  static const char* GradKernelVersion();
  const char* VariantName() const;

 private:
  ProjectionCuda() = default;

  int device_ = 0;
  ForwardVariant variant_ = ForwardVariant::kDefault;
  int num_sms_ = 0;
  int forward_ctas_per_sm_[5] = {1, 1, 1, 1, 1};  // by kernel mode
  bool owns_buffers_ = true;                      // false with Options::wrap
  float* weight_ = nullptr;    // [5376][96], owned unless wrapped
  float* weight_t_ = nullptr;  // [96][5376], owned unless wrapped
  float* bias_ = nullptr;      // [5376], owned unless wrapped, or null
};

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_CUDA_PROJECTION_CUDA_H_
