#include "server/backends/cuda_device_selection.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/backends/backend.h"

namespace detlogp::server {
namespace {

using kernels::cuda::KernelKind;

std::string Describe(const GpuInfo& gpu) {
  return absl::StrCat("cuda:", gpu.index, " ", gpu.name,
                      " (compute capability ", gpu.cc_major, ".", gpu.cc_minor,
                      ")");
}

// The kernel `gpu` runs under `choice`, or why it cannot run one.
absl::StatusOr<KernelKind> KernelFor(const GpuInfo& gpu,
                                     LogpKernelChoice choice) {
  switch (choice) {
    case LogpKernelChoice::kHopper:
      if (!kernels::cuda::KernelRunsOn(KernelKind::kHopper, gpu.cc_major,
                                       gpu.cc_minor)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "--logp_kernel=hopper: ", Describe(gpu),
            " cannot run the Hopper kernel (compute capability 9.0 only); use "
            "--logp_kernel=auto or portable"));
      }
      return KernelKind::kHopper;
    case LogpKernelChoice::kPortable:
      if (!kernels::cuda::KernelRunsOn(KernelKind::kPortable, gpu.cc_major,
                                       gpu.cc_minor)) {
        return absl::FailedPreconditionError(
            absl::StrCat("--logp_kernel=portable: ", Describe(gpu),
                         " is below compute capability 8.0"));
      }
      return KernelKind::kPortable;
    case LogpKernelChoice::kAuto:
      break;
  }
  auto kernel = kernels::cuda::DefaultKernelFor(gpu.cc_major, gpu.cc_minor);
  if (!kernel.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(Describe(gpu), ": ", kernel.status().message()));
  }
  return *kernel;
}

bool SameKind(const GpuInfo& a, const GpuInfo& b) {
  return a.name == b.name && a.cc_major == b.cc_major &&
         a.cc_minor == b.cc_minor;
}

}  // namespace

absl::StatusOr<LogpKernelChoice> ParseLogpKernelChoice(
    absl::string_view value) {
  if (value.empty() || value == "auto") return LogpKernelChoice::kAuto;
  if (value == "hopper") return LogpKernelChoice::kHopper;
  if (value == "portable") return LogpKernelChoice::kPortable;
  return absl::InvalidArgumentError(absl::StrCat(
      "--logp_kernel=", value, ": expected auto, hopper or portable"));
}

absl::StatusOr<GpuSelection> SelectGpus(const std::vector<GpuInfo>& visible,
                                        int device_index, bool vocab_parallel,
                                        LogpKernelChoice choice) {
  GpuSelection selection;
  if (device_index >= 0) {
    if (device_index >= static_cast<int>(visible.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda:", device_index, " requested but only ",
                       visible.size(), " GPU(s) visible"));
    }
    const GpuInfo& gpu = visible[device_index];
    auto kernel = KernelFor(gpu, choice);
    if (!kernel.ok()) return kernel.status();
    selection.devices = {gpu.index};
    selection.kernel = *kernel;
    selection.name = gpu.name;
    selection.cc_major = gpu.cc_major;
    selection.cc_minor = gpu.cc_minor;
    return selection;
  }
  const GpuInfo* first = nullptr;
  std::vector<std::string> unsuitable;
  for (const GpuInfo& gpu : visible) {
    auto kernel = KernelFor(gpu, choice);
    if (!kernel.ok()) {
      unsuitable.push_back(std::string(kernel.status().message()));
      continue;
    }
    if (first == nullptr) {
      first = &gpu;
      selection.kernel = *kernel;
      selection.name = gpu.name;
      selection.cc_major = gpu.cc_major;
      selection.cc_minor = gpu.cc_minor;
    } else if (!SameKind(gpu, *first)) {
      selection.left_out.push_back(Describe(gpu));
      continue;
    }
    selection.devices.push_back(gpu.index);
    if (device_index == kFirstSuitableDevice) break;
  }
  if (first == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "no GPU can run a linear-logp kernel: ",
        unsuitable.empty() ? "none visible" : absl::StrJoin(unsuitable, "; ")));
  }
  if (vocab_parallel && !selection.left_out.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--vocab_parallel needs GPUs of one kind (one kernel build, one "
        "determinism key), but ",
        Describe(*first), " differs from ",
        absl::StrJoin(selection.left_out, ", "),
        "; use CUDA_VISIBLE_DEVICES to pick GPUs of one kind"));
  }
  return selection;
}

}  // namespace detlogp::server
