// Float64 reference for the fused linear-logp, on the same bf16 inputs the
// kernels see. Tests only.
#ifndef DETLOGP_TESTS_LINEAR_LOGP_REFERENCE_H_
#define DETLOGP_TESTS_LINEAR_LOGP_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/lm_head.h"

namespace detlogp::testing {

struct ReferenceRow {
  double logprob;
  double lse;
};

// z = (h . W[v] + b[v]) / T over the real vocabulary, in float64.
inline std::vector<double> ReferenceLogits(const kernels::LmHeadView& head,
                                           const uint16_t* hidden,
                                           double temperature) {
  std::vector<double> z(head.vocab_size);
  for (int64_t v = 0; v < head.vocab_size; ++v) {
    double dot = 0.0;
    for (int64_t k = 0; k < head.hidden_size; ++k) {
      dot += static_cast<double>(kernels::Bf16ToFloat(hidden[k])) *
             kernels::Bf16ToFloat(head.weight[v * head.hidden_size + k]);
    }
    if (head.bias != nullptr) dot += head.bias[v];
    z[v] = dot / temperature;
  }
  return z;
}

inline double ReferenceLogSumExp(const std::vector<double>& z) {
  const double max_z = *std::max_element(z.begin(), z.end());
  double sum = 0.0;
  for (double value : z) sum += std::exp(value - max_z);
  return max_z + std::log(sum);
}

inline ReferenceRow ReferenceLinearLogp(const kernels::LmHeadView& head,
                                        const uint16_t* hidden, int32_t target,
                                        double temperature) {
  const std::vector<double> z = ReferenceLogits(head, hidden, temperature);
  const double lse = ReferenceLogSumExp(z);
  return {z[target] - lse, lse};
}

// Entropy and the full ranking of one row, in float64.
struct ReferenceExtras {
  double lse;
  double entropy;               // lse - sum_v p_v z_v
  std::vector<int32_t> ranked;  // every id, by descending z, ties to lower id
  std::vector<double> z;        // z[v]
};

inline ReferenceExtras ReferenceEntropyAndRanking(
    const kernels::LmHeadView& head, const uint16_t* hidden,
    double temperature) {
  ReferenceExtras out;
  out.z = ReferenceLogits(head, hidden, temperature);
  out.lse = ReferenceLogSumExp(out.z);
  double mean_z = 0.0;
  for (double value : out.z) mean_z += std::exp(value - out.lse) * value;
  out.entropy = out.lse - mean_z;
  out.ranked.resize(out.z.size());
  std::iota(out.ranked.begin(), out.ranked.end(), 0);
  std::stable_sort(out.ranked.begin(), out.ranked.end(),
                   [&](int32_t a, int32_t b) { return out.z[a] > out.z[b]; });
  return out;
}

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_LINEAR_LOGP_REFERENCE_H_
