// Host-side helpers shared by the CUDA launchers (linear-logp forward and
// backward, H3 projection): CUDA errors as absl::Status, the current device
// for a scope, pointer alignment, and bf16 TMA tensor maps. Header-only:
// nvcc compiles the launchers from a genrule (third_party/cuda/cuda.bzl).
#ifndef DETLOGP_KERNELS_CUDA_CUDA_HOST_H_
#define DETLOGP_KERNELS_CUDA_CUDA_HOST_H_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace detlogp::kernels::cuda {

// "<component>: <what>: <error name> (<description>)".
inline absl::Status CudaErrorStatus(const char* component, cudaError_t err,
                                    const char* what) {
  return absl::InternalError(absl::StrCat(component, ": ", what, ": ",
                                          cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

// Returns the error of a CUDA runtime call as a status naming the call and
// kCudaComponent, a string constant each launcher defines in its unnamed
// namespace (e.g. "linear_logp_cuda").
#define DETLOGP_CUDA_RETURN_IF_ERROR(expr)                                   \
  do {                                                                       \
    const cudaError_t detlogp_err_ = (expr);                                 \
    if (detlogp_err_ != cudaSuccess) {                                       \
      return ::detlogp::kernels::cuda::CudaErrorStatus(kCudaComponent,       \
                                                       detlogp_err_, #expr); \
    }                                                                        \
  } while (0)

inline bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// Makes a device current until the scope ends, then restores the caller's.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  absl::Status Enter(int device) {
    static constexpr char kCudaComponent[] = "cuda";
    DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous_));
    if (previous_ != device) {
      DETLOGP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
      switched_ = true;
    }
    return absl::OkStatus();
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// The driver's cuTensorMapEncodeTiled, through the runtime (no -lcuda).
inline absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> TensorMapEncoder(
    const char* component) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(
      "cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &query);
  if (err != cudaSuccess) {
    return CudaErrorStatus(component, err, "cudaGetDriverEntryPointByVersion");
  }
  if (query != cudaDriverEntryPointSuccess || fn == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(component, ": cuTensorMapEncodeTiled not available"));
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// A 2-D bf16 tensor map with the 128-byte swizzle: `inner` contiguous
// elements per row, rows `row_stride` elements apart, `outer` rows; boxes of
// {box_inner, box_outer} (box_inner * 2 <= 128 bytes).
inline absl::Status EncodeBf16TensorMap(
    PFN_cuTensorMapEncodeTiled_v12000 encode, const char* component,
    CUtensorMap* map, const void* base, int64_t inner, int64_t outer,
    int64_t row_stride, uint32_t box_inner, uint32_t box_outer) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner),
                              static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 2};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base),
             dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        component, ": cuTensorMapEncodeTiled failed: ", static_cast<int>(r)));
  }
  return absl::OkStatus();
}

}  // namespace detlogp::kernels::cuda

#endif  // DETLOGP_KERNELS_CUDA_CUDA_HOST_H_
