// The per-split partial softmax state and the one rule that combines them.
//
// A split reduces its logits to (max, sum of exp(z - max)). Partials are
// folded left to right in ascending split order, always starting from the
// split-0 state, so the result depends only on the split policy (a function of
// V) and never on how rows were batched. Shared by the CPU and CUDA backends.
#ifndef DETLOGP_KERNELS_SOFTMAX_PARTIAL_H_
#define DETLOGP_KERNELS_SOFTMAX_PARTIAL_H_

#include <math.h>
#include <stdint.h>

#include "kernels/host_device.h"

namespace detlogp::kernels {

struct SoftmaxPartial {
  float max;      // largest logit seen in the split
  float sum_exp;  // sum of exp(z - max) over the split
};

// Folds `next` into `acc`. Both states come from non-empty splits, so their
// maxima are finite for finite inputs.
DETLOGP_HOST_DEVICE inline SoftmaxPartial CombinePartials(SoftmaxPartial acc,
                                                          SoftmaxPartial next) {
  const float m = fmaxf(acc.max, next.max);
  return SoftmaxPartial{
      m, acc.sum_exp * expf(acc.max - m) + next.sum_exp * expf(next.max - m)};
}

// logsumexp of the whole vocabulary from the folded state.
DETLOGP_HOST_DEVICE inline float PartialLogSumExp(SoftmaxPartial total) {
  return total.max + logf(total.sum_exp);
}

// A split's state when entropy is asked for: the softmax partial plus
// sum of exp(z - max) * z. Entropy = lse - sum_exp_z / sum_exp over the
// folded state. The CUDA kernel stores a split as {lse_s, 1, mean z}, the
// same quantity scaled by the split's sum.
struct EntropyPartial {
  SoftmaxPartial softmax;
  float sum_exp_z;
};

// Folds `next` into `acc` with the same rescaling as CombinePartials.
// Callers that also need lse take it from CombinePartials over the softmax
// states, so asking for entropy never changes lse bits.
DETLOGP_HOST_DEVICE inline float CombineEntropySums(EntropyPartial acc,
                                                    EntropyPartial next,
                                                    float combined_max) {
  return acc.sum_exp_z * expf(acc.softmax.max - combined_max) +
         next.sum_exp_z * expf(next.softmax.max - combined_max);
}

// The entropy of the folded state whose logsumexp is `lse`.
DETLOGP_HOST_DEVICE inline float PartialEntropy(SoftmaxPartial total,
                                                float sum_exp_z, float lse) {
  return lse - sum_exp_z / total.sum_exp;
}

// The order top-k lists keep: larger z first, ties to the lower token id.
// A total order on (z, id), so the k best of any set are one set whatever
// order candidates arrive in.
DETLOGP_HOST_DEVICE inline bool RanksBefore(float z_a, int32_t id_a, float z_b,
                                            int32_t id_b) {
  return z_a > z_b || (z_a == z_b && id_a < id_b);
}

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_SOFTMAX_PARTIAL_H_
