// The per-split partial softmax state and the one rule that combines them.
//
// A split reduces its logits to (max, sum of exp(z - max)). Partials are
// folded left to right in ascending split order, always starting from the
// split-0 state, so the result depends only on the split policy (a function of
// V) and never on how rows were batched. Shared by the CPU and CUDA backends.
#ifndef DETLOGP_KERNELS_SOFTMAX_PARTIAL_H_
#define DETLOGP_KERNELS_SOFTMAX_PARTIAL_H_

#include <math.h>

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

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_SOFTMAX_PARTIAL_H_
