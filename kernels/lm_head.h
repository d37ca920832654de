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

// Largest top_k any kernel computes (the CUDA kernel keeps one list of this
// many candidates per row in shared memory).
inline constexpr int32_t kMaxTopK = 32;

// Rows to score. Inputs are already validated: targets in [0, vocab_size),
// temperatures finite and positive, 0 <= top_k <= min(kMaxTopK, vocab_size).
struct LogpRowsView {
  int64_t rows = 0;
  const uint16_t* hidden = nullptr;     // bf16 bits, [rows, H]
  const int32_t* targets = nullptr;     // [rows]
  const float* temperatures = nullptr;  // [rows]
  float* logprobs = nullptr;            // [rows] out
  float* lse = nullptr;                 // [rows] out
  // Optional outputs. Asking for them never changes logprobs or lse bits.
  float* entropy = nullptr;       // [rows] out, or null: not computed
  int32_t top_k = 0;              // the same k for every row; 0: none
  int32_t* top_ids = nullptr;     // [rows, top_k] out, descending
  float* top_logprobs = nullptr;  // [rows, top_k] out: z - lse
};

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_LM_HEAD_H_
