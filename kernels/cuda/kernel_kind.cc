#include "kernels/cuda/kernel_kind.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace detlogp::kernels::cuda {

const char* KernelKindName(KernelKind kernel) {
  return kernel == KernelKind::kHopper ? "hopper" : "portable";
}

bool KernelRunsOn(KernelKind kernel, int cc_major, int cc_minor) {
  if (kernel == KernelKind::kHopper) return cc_major == 9 && cc_minor == 0;
  return cc_major >= 8;
}

absl::StatusOr<KernelKind> DefaultKernelFor(int cc_major, int cc_minor) {
  if (KernelRunsOn(KernelKind::kHopper, cc_major, cc_minor)) {
    return KernelKind::kHopper;
  }
  if (KernelRunsOn(KernelKind::kPortable, cc_major, cc_minor)) {
    return KernelKind::kPortable;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "compute capability ", cc_major, ".", cc_minor,
      " is below 8.0: the CUDA kernels need an Ampere or newer GPU"));
}

std::string PortableInstructionSet(int cc_major, int cc_minor,
                                   int binary_version, int ptx_version,
                                   int driver_version,
                                   absl::Span<const int> shipped_sass) {
  const std::string device = absl::StrCat("sm_", cc_major, cc_minor);
  const bool shipped = std::find(shipped_sass.begin(), shipped_sass.end(),
                                 binary_version) != shipped_sass.end();
  if (shipped) {
    return absl::StrCat(device, "/sass_sm_", binary_version);
  }
  return absl::StrCat(device, "/jit_compute_", ptx_version, "/driver_",
                      driver_version);
}

int BestShippedSass(int cc_major, int cc_minor,
                    absl::Span<const int> shipped_sass) {
  int best = 0;
  for (int arch : shipped_sass) {
    if (arch / 10 == cc_major && arch % 10 <= cc_minor && arch > best) {
      best = arch;
    }
  }
  return best;
}

}  // namespace detlogp::kernels::cuda
