#include "digests/determinism_key.h"

#include "absl/strings/str_cat.h"
#include "digests/sha256.h"

namespace detlogp::digests {

std::string DeterminismKey(const DeterminismInputs& inputs) {
  const std::string canonical = absl::StrCat(
      "weights=", inputs.weights_sha256, "\nbackend=", inputs.backend,
      "\nisa=", inputs.instruction_set, "\nkernel=", inputs.kernel_version,
      "\nsplit=", inputs.split_policy, "\n");
  return absl::StrCat("dk1-", Sha256Hex(canonical).substr(0, 32));
}

}  // namespace detlogp::digests
