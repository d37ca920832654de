// The determinism key: equal keys mean equal bits for equal rows. It is a
// digest of everything that can change a row's bits: the weights, the backend
// and its instruction set, the kernel version and the split policy.
#ifndef DETLOGP_DIGESTS_DETERMINISM_KEY_H_
#define DETLOGP_DIGESTS_DETERMINISM_KEY_H_

#include <string>

namespace detlogp::digests {

struct DeterminismInputs {
  std::string weights_sha256;
  std::string backend;
  std::string instruction_set;
  std::string kernel_version;
  std::string split_policy;
};

// "dk1-" followed by 32 hex digits of SHA-256 over the inputs.
std::string DeterminismKey(const DeterminismInputs& inputs);

}  // namespace detlogp::digests

#endif  // DETLOGP_DIGESTS_DETERMINISM_KEY_H_
