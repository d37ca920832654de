// Float64 reference for the fused linear-logp, on the same bf16 inputs the
// kernels see. Tests only.
#ifndef DETLOGP_TESTS_LINEAR_LOGP_REFERENCE_H_
#define DETLOGP_TESTS_LINEAR_LOGP_REFERENCE_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/lm_head.h"

namespace detlogp::testing {

struct ReferenceRow {
  double logprob;
  double lse;
};

inline ReferenceRow ReferenceLinearLogp(const kernels::LmHeadView& head,
                                        const uint16_t* hidden, int32_t target,
                                        double temperature) {
  std::vector<double> z(head.vocab_size);
  double max_z = -INFINITY;
  for (int64_t v = 0; v < head.vocab_size; ++v) {
    double dot = 0.0;
    for (int64_t k = 0; k < head.hidden_size; ++k) {
      dot += static_cast<double>(kernels::Bf16ToFloat(hidden[k])) *
             kernels::Bf16ToFloat(head.weight[v * head.hidden_size + k]);
    }
    if (head.bias != nullptr) dot += head.bias[v];
    z[v] = dot / temperature;
    max_z = std::max(max_z, z[v]);
  }
  double sum = 0.0;
  for (double value : z) sum += std::exp(value - max_z);
  const double lse = max_z + std::log(sum);
  return {z[target] - lse, lse};
}

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_LINEAR_LOGP_REFERENCE_H_
