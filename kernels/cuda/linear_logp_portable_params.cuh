// Constants and launch parameters of the portable linear-logp kernel
// (linear_logp_portable_kernel.cuh has the kernel and its contract). Apart
// from the kernel so that the host launcher (linear_logp_cuda.cu, built for
// sm_90a) can fill KernelParams without compiling the kernel itself: the
// kernel's only code is in linear_logp_portable.cu, built for every
// architecture the portable kernel ships for.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_PARAMS_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_PARAMS_CUH_

#include <cuda_bf16.h>

#include <cstdint>

namespace detlogp::kernels::cuda::portable_v1 {

inline constexpr char kVersion[] = "portable-mma-sync-v1";

inline constexpr int kBlockN = 128;            // vocabulary columns per tile
inline constexpr int kBlockK = 64;             // bf16 per shared row: 128 bytes
inline constexpr int kRowBytes = kBlockK * 2;  // 128
inline constexpr int kChunksPerRow = kRowBytes / 16;  // 8
inline constexpr int kMaxSplits = 256;  // as v3: 4 B per split, <= 1 KiB/row
inline constexpr int kMaxTopK = 32;     // as v3 (kernels/lm_head.h)
// Shared memory per block the kernel needs on any GPU: every tiling has a
// variant within it (99 KiB is the opt-in maximum of sm_86/sm_89, the
// smallest of sm_80+).
inline constexpr int kMinSmemBytes = 96 * 1024;

static_assert(kBlockK % 16 == 0, "k16 steps");
static_assert(kChunksPerRow == 8, "the swizzle handles 128-byte rows");

struct KernelParams {
  const __nv_bfloat16* hidden;  // [rows][hidden]
  const __nv_bfloat16* weight;  // [padded_vocab][hidden]
  const float* bias;            // [padded_vocab] or null
  const int32_t* targets;       // [rows], or null: targets64
  const int64_t* targets64;     // [rows] when targets is null
  const float* temperatures;    // [rows], or null: temperature
  float temperature;            // every row's, when temperatures is null
  float* logprobs;              // [rows]: z[target] here
  float* split_lse;             // [rows][num_splits]: logsumexp of split
  float* split_mean_z;          // [rows][num_splits] or null: no entropy
  float* split_top_z;           // [rows][num_splits][top_k] or null
  int32_t* split_top_id;        // [rows][num_splits][top_k] (top_k > 0)
  uint32_t* top_screen;         // [rows][kScreenWords], zeroed, or null
  int32_t top_k;                // 0 (none) or 1..kMaxTopK
  int32_t id_offset;            // added to top-k ids (a shard's first row)
  int64_t hidden_size;          // H, a multiple of 64
  int64_t padded_vocab;         // weight rows that may be read
  int32_t rows;
  int32_t k_blocks;  // H / kBlockK
  int32_t num_splits;
  int32_t num_row_blocks;  // set by EnqueueSplitKernel (its tiling)
  int32_t row_group;       // row blocks taken together (item_order.h)
  int32_t split_begin[kMaxSplits + 1];  // split s is [begin[s], begin[s+1])
};

}  // namespace detlogp::kernels::cuda::portable_v1

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_PARAMS_CUH_
