// Plain views over the lm_head and over one batch of rows, as every backend
// sees them. Views never own memory.
#ifndef DETLOGP_KERNELS_LM_HEAD_H_
#define DETLOGP_KERNELS_LM_HEAD_H_

#include <cstdint>

namespace detlogp::kernels {

// The projection z[v] = h . W[v] + b[v], W held in bf16, row-major [V_pad, H].
struct LmHeadView {
  int64_t hidden_size = 0;        // H
  int64_t vocab_size = 0;         // real vocabulary; rows >= this never count
  int64_t padded_vocab_size = 0;  // rows of `weight`
  const uint16_t* weight = nullptr;  // bf16 bits, [padded_vocab_size, H]
  const float* bias = nullptr;       // [padded_vocab_size] or null
};

// Rows to score. Inputs are already validated: targets in [0, vocab_size),
// temperatures finite and positive.
struct LogpRowsView {
  int64_t rows = 0;
  const uint16_t* hidden = nullptr;     // bf16 bits, [rows, H]
  const int32_t* targets = nullptr;     // [rows]
  const float* temperatures = nullptr;  // [rows]
  float* logprobs = nullptr;            // [rows] out
  float* lse = nullptr;                 // [rows] out
};

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_LM_HEAD_H_
