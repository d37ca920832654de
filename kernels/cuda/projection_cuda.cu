#include "kernels/cuda/projection_cuda.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_host.h"
#include "kernels/cuda/projection_forward_kernel.cuh"
#include "kernels/cuda/projection_forward_wide_kernel.cuh"
#include "kernels/cuda/projection_input_grad_kernel.cuh"
#include "kernels/cuda/projection_weight_grad_kernel.cuh"
#include "kernels/projection.h"
#include "kernels/projection_grad.h"

namespace detlogp::kernels {
namespace {

using cuda_detail::kFwdStageBytes;
using cuda_detail::kFwdThreads;

static_assert(cuda_detail::kFwdK == kProjectionInDim);
static_assert(cuda_detail::kFwdN == kProjectionOutDim);
static_assert(cuda_detail::kDxChunk == kInputGradChunk);
static_assert(cuda_detail::kDwChunk == kRowKeyChunk);
static_assert(cuda_detail::kDwSuperKeys == kRowKeyChunk * kRowKeySuperChunk);

// kDefault picks per call by rows, from same-run measurements on the H200
// (every variant gives the same bits, so the choice never changes results):
// the wide kernel from kWideMinRows rows, where its 21 column tiles fill the
// GPU; the single-stage kernel below.
constexpr int64_t kWideMinRows = 8192;

// dX splits the 42 chunks over CTAs (ProjectionInputGradKernel<true> + the
// in-order fold) up to this many rows when the caller gives a workspace;
// above it the one-pass kernel already has >= 64 row tiles, and the
// [42][rows][96] workspace would outgrow PyTorch's own backward peak.
constexpr int64_t kDxSplitMaxRows = 8192;
constexpr int64_t kDxChunks = kProjectionOutDim / kInputGradChunk;  // 42

// dW splits the 96 columns over 3 CTAs while 42 o-tiles x superchunks would
// leave SMs idle (same bits: every dW element keeps its own chain).
constexpr int kDwKParts = 3;

constexpr char kCudaComponent[] = "projection_cuda";

// Makes `device` current for a scope, restoring the caller's device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    ok_ = cudaGetDevice(&saved_) == cudaSuccess &&
          cudaSetDevice(device) == cudaSuccess;
  }
  ~DeviceScope() { cudaSetDevice(saved_); }
  bool ok() const { return ok_; }

 private:
  int saved_ = 0;
  bool ok_ = false;
};

__global__ void TransposeWeight(const float* __restrict__ w,
                                float* __restrict__ wt) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= kProjectionOutDim * kProjectionInDim) return;
  const int64_t o = i / kProjectionInDim, k = i % kProjectionInDim;
  wt[k * kProjectionOutDim + o] = w[i];
}

template <int kMode, bool kHasBias>
auto ForwardKernel() {
  return &cuda_detail::ProjectionForwardKernel<kMode, kHasBias>;
}

// Kernel mode of a variant for `rows`; see projection_forward_kernel.cuh.
int ModeOf(ProjectionCuda::ForwardVariant v, int64_t rows) {
  switch (v) {
    case ProjectionCuda::ForwardVariant::kDefault:
      return rows >= kWideMinRows ? 4 : 1;
    case ProjectionCuda::ForwardVariant::kSingleStage:
      return 1;
    case ProjectionCuda::ForwardVariant::kDoubleBuffered:
      return 2;
    case ProjectionCuda::ForwardVariant::kWide:
      return 4;
    case ProjectionCuda::ForwardVariant::kSplitLoad:
      return 3;
  }
  return 1;
}

using ForwardFn = void (*)(const float*, const float*, const float*, float*,
                           int64_t, int64_t);

ForwardFn ForwardKernelFor(int mode, bool has_bias) {
  switch (mode) {
    case 1:
      return has_bias ? ForwardKernel<1, true>() : ForwardKernel<1, false>();
    case 2:
      return has_bias ? ForwardKernel<2, true>() : ForwardKernel<2, false>();
    case 4:
      return has_bias ? &cuda_detail::ProjectionForwardWideKernel<true>
                      : &cuda_detail::ProjectionForwardWideKernel<false>;
    default:
      return has_bias ? ForwardKernel<3, true>() : ForwardKernel<3, false>();
  }
}

int ForwardSmemBytes(int mode) {
  return mode == 4   ? cuda_detail::kWideSmemBytes
         : mode == 2 ? 2 * kFwdStageBytes
                     : kFwdStageBytes;
}

// Superchunks (4096 keys) touched by keys [first_key, first_key + rows).
int64_t SuperchunksTouched(int64_t rows, int64_t first_key) {
  if (rows <= 0) return 0;
  return (first_key + rows - 1) / cuda_detail::kDwSuperKeys -
         first_key / cuda_detail::kDwSuperKeys + 1;
}

bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ProjectionCuda>> ProjectionCuda::Create(
    const Options& options) {
  if (options.weight == nullptr) {
    return absl::InvalidArgumentError("ProjectionCuda: weight is null");
  }
  int device_count = 0;
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&device_count));
  if (options.device < 0 || options.device >= device_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("ProjectionCuda: device ", options.device, " not in [0, ",
                     device_count, ")"));
  }
  DeviceScope scope(options.device);
  if (!scope.ok()) return absl::InternalError("cudaSetDevice failed");

  std::unique_ptr<ProjectionCuda> p(new ProjectionCuda());
  p->device_ = options.device;
  p->variant_ = options.variant;
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &p->num_sms_, cudaDevAttrMultiProcessorCount, options.device));
  int smem_optin = 0;
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, options.device));
  const int fwd_smem_max =
      std::max(2 * kFwdStageBytes, cuda_detail::kWideSmemBytes);
  const int dx_smem = 2 * cuda_detail::kDxStageBytes;
  const int dw_smem = 2 * cuda_detail::kDwStageBytes;
  if (smem_optin < std::max(fwd_smem_max, dx_smem)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ProjectionCuda needs ", std::max(fwd_smem_max, dx_smem),
        " bytes of shared memory per block; the device offers ", smem_optin));
  }
  for (auto kernel : {ForwardKernel<1, true>(), ForwardKernel<1, false>(),
                      ForwardKernel<2, true>(), ForwardKernel<2, false>(),
                      ForwardKernel<3, true>(), ForwardKernel<3, false>(),
                      ForwardKernelFor(4, true), ForwardKernelFor(4, false)}) {
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, fwd_smem_max));
  }
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      cuda_detail::ProjectionInputGradKernel<false>,
      cudaFuncAttributeMaxDynamicSharedMemorySize, dx_smem));
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      cuda_detail::ProjectionInputGradKernel<true>,
      cudaFuncAttributeMaxDynamicSharedMemorySize, dx_smem));
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      cuda_detail::ProjectionWeightGradKernel<1>,
      cudaFuncAttributeMaxDynamicSharedMemorySize, dw_smem));
  DETLOGP_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(cuda_detail::ProjectionWeightGradKernel<kDwKParts>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                           2 * 4 * cuda_detail::kDwStageFloatsFor<kDwKParts>));
  for (int mode = 1; mode <= 4; ++mode) {
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &p->forward_ctas_per_sm_[mode], ForwardKernelFor(mode, true),
        kFwdThreads, ForwardSmemBytes(mode)));
    if (p->forward_ctas_per_sm_[mode] < 1) {
      return absl::FailedPreconditionError(
          absl::StrCat("forward kernel mode ", mode, " cannot be resident"));
    }
  }

  if (options.wrap) {
    p->owns_buffers_ = false;
    p->weight_ = const_cast<float*>(options.weight);
    p->weight_t_ = const_cast<float*>(options.weight_t);
    p->bias_ = const_cast<float*>(options.bias);
    return p;
  }
  constexpr size_t kWeightBytes =
      sizeof(float) * kProjectionOutDim * kProjectionInDim;
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p->weight_, kWeightBytes));
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p->weight_t_, kWeightBytes));
  // Copies on the legacy stream, then wait: the caller's buffers may go.
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      p->weight_, options.weight, kWeightBytes, cudaMemcpyDeviceToDevice));
  if (options.bias != nullptr) {
    DETLOGP_CUDA_RETURN_IF_ERROR(
        cudaMalloc(&p->bias_, sizeof(float) * kProjectionOutDim));
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaMemcpy(p->bias_, options.bias,
                                            sizeof(float) * kProjectionOutDim,
                                            cudaMemcpyDeviceToDevice));
  }
  constexpr int kBlock = 256;
  TransposeWeight<<<
      (kProjectionOutDim * kProjectionInDim + kBlock - 1) / kBlock, kBlock>>>(
      p->weight_, p->weight_t_);
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return p;
}

ProjectionCuda::~ProjectionCuda() {
  if (!owns_buffers_) return;
  DeviceScope scope(device_);
  cudaFree(weight_);
  cudaFree(weight_t_);
  cudaFree(bias_);
}

absl::Status ProjectionCuda::LaunchTransposeWeight(const float* weight,
                                                   float* weight_t, int device,
                                                   cudaStream_t stream) {
  if (weight == nullptr || weight_t == nullptr) {
    return absl::InvalidArgumentError(
        "ProjectionCuda::LaunchTransposeWeight: null pointer");
  }
  DeviceScope scope(device);
  if (!scope.ok()) return absl::InternalError("cudaSetDevice failed");
  constexpr int kBlock = 256;
  TransposeWeight<<<(kProjectionOutDim * kProjectionInDim + kBlock - 1) /
                        kBlock,
                    kBlock, 0, stream>>>(weight, weight_t);
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status ProjectionCuda::Forward(const float* x, int64_t rows, float* y,
                                     cudaStream_t stream) const {
  if (rows < 0 || rows > kProjectionMaxRows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows must be in [0, kProjectionMaxRows=", kProjectionMaxRows,
        "], got ", rows));
  }
  if (rows == 0) return absl::OkStatus();
  if (x == nullptr || y == nullptr || !Aligned16(x) || !Aligned16(y)) {
    return absl::InvalidArgumentError(
        "ProjectionCuda::Forward: x and y must be non-null, 16-byte aligned");
  }
  if (weight_t_ == nullptr) {
    return absl::FailedPreconditionError(
        "ProjectionCuda::Forward: wrapped without weight_t");
  }
  DeviceScope scope(device_);
  if (!scope.ok()) return absl::InternalError("cudaSetDevice failed");
  const int64_t row_tiles =
      (rows + cuda_detail::kFwdBM - 1) / cuda_detail::kFwdBM;
  const int mode = ModeOf(variant_, rows);
  // The grid only spreads whole tiles over CTAs: it never changes bits.
  const int64_t num_tiles = row_tiles * (mode == 4 ? cuda_detail::kWideNTiles
                                                   : cuda_detail::kFwdNTiles);
  const int64_t grid = std::min<int64_t>(
      num_tiles, static_cast<int64_t>(num_sms_) * forward_ctas_per_sm_[mode]);
  ForwardFn kernel = ForwardKernelFor(mode, bias_ != nullptr);
  kernel<<<static_cast<unsigned>(grid), kFwdThreads, ForwardSmemBytes(mode),
           stream>>>(x, weight_t_, bias_, y, rows,
                     mode == 4 ? row_tiles : num_tiles);
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status ProjectionCuda::InputGrad(const float* dy, int64_t rows, float* dx,
                                       cudaStream_t stream) const {
  return InputGrad(dy, rows, dx, nullptr, 0, stream);
}

int64_t ProjectionCuda::InputGradWorkspaceBytes(int64_t rows) {
  // Up to kDxRowSerialMaxRows rows the row-serial kernel needs none.
  if (rows <= cuda_detail::kDxRowSerialMaxRows || rows > kDxSplitMaxRows) {
    return 0;
  }
  return kDxChunks * rows * kProjectionInDim *
         static_cast<int64_t>(sizeof(float));
}

absl::Status ProjectionCuda::InputGrad(const float* dy, int64_t rows, float* dx,
                                       void* workspace, int64_t workspace_bytes,
                                       cudaStream_t stream) const {
  // One CTA per 128 rows: the grid's x dimension bounds the rows.
  constexpr int64_t kMaxRows = int64_t{0x7fffffff} * cuda_detail::kDxBM;
  if (rows < 0 || rows > std::min(kMaxRows, kProjectionMaxRows)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ProjectionCuda::InputGrad: rows must be in [0, ",
                     std::min(kMaxRows, kProjectionMaxRows), "], got ", rows));
  }
  if (rows == 0) return absl::OkStatus();
  if (dy == nullptr || dx == nullptr || !Aligned16(dy) || !Aligned16(dx)) {
    return absl::InvalidArgumentError(
        "ProjectionCuda::InputGrad: dy and dx must be non-null, 16-byte "
        "aligned");
  }
  DeviceScope scope(device_);
  if (!scope.ok()) return absl::InternalError("cudaSetDevice failed");
  if (rows <= cuda_detail::kDxRowSerialMaxRows) {
    cuda_detail::ProjectionInputGradRowSerialKernel<<<
        static_cast<unsigned>(rows), cuda_detail::kDxN, 0, stream>>>(
        dy, weight_, dx);
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }
  const int64_t grid = (rows + cuda_detail::kDxBM - 1) / cuda_detail::kDxBM;
  const int64_t ws_needed = InputGradWorkspaceBytes(rows);
  if (workspace != nullptr && ws_needed > 0) {
    if (!Aligned16(workspace) || workspace_bytes < ws_needed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ProjectionCuda::InputGrad: workspace must be 16-byte aligned and "
          "hold InputGradWorkspaceBytes=",
          ws_needed, " bytes, got ", workspace_bytes));
    }
    // Chunk partials in parallel, then the in-order fold (same bits).
    float* ws = static_cast<float*>(workspace);
    const dim3 grid_split(static_cast<unsigned>(grid),
                          static_cast<unsigned>(kDxChunks));
    cuda_detail::ProjectionInputGradKernel<true>
        <<<grid_split, cuda_detail::kDxThreads, 2 * cuda_detail::kDxStageBytes,
           stream>>>(dy, weight_, ws, rows);
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    const int64_t n = rows * kProjectionInDim;
    constexpr int kBlock = 256;
    cuda_detail::
        DxFoldChunks<<<static_cast<unsigned>((n / 4 + kBlock - 1) / kBlock),
                       kBlock, 0, stream>>>(ws, n, dx);
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }
  cuda_detail::ProjectionInputGradKernel<false>
      <<<static_cast<unsigned>(grid), cuda_detail::kDxThreads,
         2 * cuda_detail::kDxStageBytes, stream>>>(dy, weight_, dx, rows);
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

int64_t ProjectionCuda::WeightGradWorkspaceBytes(int64_t rows,
                                                 int64_t first_key) {
  const int64_t supers = SuperchunksTouched(rows, first_key);
  if (supers <= 1) return 0;  // the single total is written directly
  return supers * (kProjectionOutDim * kProjectionInDim + kProjectionOutDim) *
         static_cast<int64_t>(sizeof(float));
}

absl::Status ProjectionCuda::WeightGrad(const float* dy, const float* x,
                                        int64_t rows, int64_t first_key,
                                        float* dweight, float* dbias,
                                        void* workspace,
                                        int64_t workspace_bytes,
                                        cudaStream_t stream) const {
  // Superchunks index grid.y: at most 65535 of them, about 268M rows.
  constexpr int64_t kMaxSuperchunks = 65535;
  if (rows < 0 || first_key < 0 || first_key > kProjectionMaxRows * 1024 ||
      rows > kProjectionMaxRows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ProjectionCuda::WeightGrad: need rows >= 0 and first_key >= 0 (keys "
        "first_key + i), got rows=",
        rows, " first_key=", first_key));
  }
  const int64_t supers = SuperchunksTouched(rows, first_key);
  if (supers > kMaxSuperchunks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ProjectionCuda::WeightGrad: ", supers, " key superchunks of ",
        cuda_detail::kDwSuperKeys, " keys exceed the limit of ",
        kMaxSuperchunks, " per call; split the batch"));
  }
  if (dweight == nullptr || !Aligned16(dweight)) {
    return absl::InvalidArgumentError(
        "ProjectionCuda::WeightGrad: dweight must be non-null, 16-byte "
        "aligned");
  }
  DeviceScope scope(device_);
  if (!scope.ok()) return absl::InternalError("cudaSetDevice failed");
  constexpr int64_t kWeightSize = kProjectionOutDim * kProjectionInDim;
  if (rows == 0) {  // no terms: +0 everywhere, like the CPU path
    DETLOGP_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(dweight, 0, kWeightSize * sizeof(float), stream));
    if (dbias != nullptr) {
      DETLOGP_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(dbias, 0, kProjectionOutDim * sizeof(float), stream));
    }
    return absl::OkStatus();
  }
  if (dy == nullptr || x == nullptr || !Aligned16(dy) || !Aligned16(x)) {
    return absl::InvalidArgumentError(
        "ProjectionCuda::WeightGrad: dy and x must be non-null, 16-byte "
        "aligned");
  }
  const int64_t ws_needed = WeightGradWorkspaceBytes(rows, first_key);
  if (ws_needed > 0 && (workspace == nullptr || !Aligned16(workspace) ||
                        workspace_bytes < ws_needed)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ProjectionCuda::WeightGrad: workspace must be 16-byte aligned and "
        "hold WeightGradWorkspaceBytes=",
        WeightGradWorkspaceBytes(rows, first_key), " bytes, got ",
        workspace_bytes));
  }
  const bool direct = ws_needed == 0;
  float* ws_w = static_cast<float*>(workspace);
  float* ws_b = direct ? nullptr : ws_w + supers * kWeightSize;
  constexpr int64_t kOTiles = kProjectionOutDim / cuda_detail::kDwBO;  // 42
  float* bias_out = dbias == nullptr ? nullptr : direct ? dbias : ws_b;
  if (kOTiles * supers < num_sms_) {  // few superchunks: split k too
    const dim3 grid_w(kOTiles, static_cast<unsigned>(supers), kDwKParts);
    cuda_detail::ProjectionWeightGradKernel<kDwKParts>
        <<<grid_w, cuda_detail::kDwThreads,
           2 * 4 * cuda_detail::kDwStageFloatsFor<kDwKParts>, stream>>>(
            dy, x, rows, first_key, ws_w, direct ? dweight : nullptr, bias_out);
  } else {
    const dim3 grid_w(kOTiles, static_cast<unsigned>(supers), 1);
    cuda_detail::ProjectionWeightGradKernel<1>
        <<<grid_w, cuda_detail::kDwThreads, 2 * cuda_detail::kDwStageBytes,
           stream>>>(dy, x, rows, first_key, ws_w, direct ? dweight : nullptr,
                     nullptr);
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    if (dbias != nullptr) {  // not fused here: see the kernel's header
      constexpr int kBlock = 256;
      const dim3 grid_b((kProjectionOutDim + kBlock - 1) / kBlock,
                        static_cast<unsigned>(supers));
      cuda_detail::ProjectionBiasGradKernel<<<grid_b, kBlock, 0, stream>>>(
          dy, rows, first_key, ws_b, direct ? dbias : nullptr);
    }
  }
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  constexpr int kBlock = 256;
  if (!direct) {
    cuda_detail::FoldSuperchunks<<<(kWeightSize + kBlock - 1) / kBlock, kBlock,
                                   0, stream>>>(ws_w, supers, kWeightSize,
                                                dweight);
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  if (dbias != nullptr) {
    if (!direct) {
      cuda_detail::FoldSuperchunks<<<(kProjectionOutDim + kBlock - 1) / kBlock,
                                     kBlock, 0, stream>>>(
          ws_b, supers, kProjectionOutDim, dbias);
      DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
  }
  return absl::OkStatus();
}

const char* ProjectionCuda::KernelVersion() {
  return "h3proj-fwd/auto:wide128x256>=8192rows,else-single-stage128x128/v1";
}

const char* ProjectionCuda::GradKernelVersion() {
  return "h3proj-bwd/"
         "dx:row-serial<=256rows,chunk-split42+fold<=8192rows(workspace),else-"
         "one-pass;"
         "dw:k-split3+fused-dbias-when-few-superchunks,else-v1/v2";
}

const char* ProjectionCuda::VariantName() const {
  if (variant_ == ForwardVariant::kDefault) return KernelVersion();
  switch (ModeOf(variant_, 0)) {
    case 1:
      return "sgemm128x128-8x8/single-stage-2cta/v1";
    case 2:
      return "sgemm128x128-8x8/double-buffered-persistent/v1";
    case 4:
      return "sgemm128x256-8x16/w-resident-x-double-buffered/v1";
    default:
      return "sgemm128x128-8x8/split-load-2cta/v1";
  }
}

}  // namespace detlogp::kernels
