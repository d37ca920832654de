// Which GPUs the CUDA log-prob backend drives and which kernel they run: a
// pure function of the visible GPUs, --device and --logp_kernel, so that the
// rules are tested on the CPU (tests/kernel_selection_test.cc).
//
// Rules:
//   * Kernel: --logp_kernel=auto runs the Hopper kernel on compute capability
//     9.0 and the portable kernel on any other GPU of compute capability
//     >= 8.0 (kernels/cuda/kernel_kind.h, DefaultKernelFor); "portable"
//     forces the portable kernel (how it is tested on an H200); "hopper"
//     forces the Hopper kernel and fails on any GPU that is not 9.0.
//   * "cuda:N": that GPU, or an error saying why not.
//   * "auto": the first GPU that can run the chosen kernel.
//   * "cuda:all", replicated: every GPU of the same kind (name and compute
//     capability) as the first suitable one; GPUs of other kinds stay idle
//     (listed in `left_out`). One kind means one kernel build and one
//     determinism key: equal keys must mean equal bits, and two kinds of GPU
//     behind one key could answer a row with different bits.
//   * "cuda:all" with vocabulary parallelism: refused when the suitable GPUs
//     are not all of one kind (every shard's partials feed one fold).
#ifndef DETLOGP_SERVER_BACKENDS_CUDA_DEVICE_SELECTION_H_
#define DETLOGP_SERVER_BACKENDS_CUDA_DEVICE_SELECTION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/kernel_kind.h"

namespace detlogp::server {

// --logp_kernel's values.
enum class LogpKernelChoice { kAuto, kHopper, kPortable };

// "auto", "hopper" or "portable" ("" means auto); INVALID_ARGUMENT naming
// --logp_kernel otherwise.
absl::StatusOr<LogpKernelChoice> ParseLogpKernelChoice(absl::string_view value);

// One visible GPU (cudaGetDeviceProperties).
struct GpuInfo {
  int index = 0;
  std::string name;  // e.g. "NVIDIA H200"
  int cc_major = 0;
  int cc_minor = 0;
};

struct GpuSelection {
  std::vector<int> devices;  // in index order, all of one kind
  kernels::cuda::KernelKind kernel = kernels::cuda::KernelKind::kHopper;
  std::string name;  // the devices' name
  int cc_major = 0;
  int cc_minor = 0;
  // "cuda:all": suitable GPUs of another kind, left idle ("cuda:3 NVIDIA
  // A100 (8.0)").
  std::vector<std::string> left_out;
};

// `device_index` is BackendOptions::device_index: N, kAllDevices or
// kFirstSuitableDevice. UNAVAILABLE when no GPU can run the kernel under
// "auto"/"all"; FAILED_PRECONDITION (naming the flag) when a named GPU
// cannot, or when vocabulary parallelism would mix GPU kinds;
// INVALID_ARGUMENT for an index past the visible GPUs.
absl::StatusOr<GpuSelection> SelectGpus(const std::vector<GpuInfo>& visible,
                                        int device_index, bool vocab_parallel,
                                        LogpKernelChoice choice);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CUDA_DEVICE_SELECTION_H_
