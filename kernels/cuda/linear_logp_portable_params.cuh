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

inline constexpr int kBlockM = 128;  // rows per item
inline constexpr int kBlockN = 128;  // vocabulary columns per tile
inline constexpr int kBlockK = 64;   // bf16 per shared row: 128 bytes
inline constexpr int kStages = 3;
// Two CTAs per SM where shared memory allows (sm_80, sm_90: 16 warps to
// hide the mma and copy latencies); registers are capped for it.
inline constexpr int kMinBlocksPerSm = 2;
inline constexpr int kWarps = 8;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kWarpRows = kBlockM / kWarps;  // 16: one m16 fragment
inline constexpr int kNFrags = kBlockN / 8;         // 16 n8 fragments
inline constexpr int kRowBytes = kBlockK * 2;       // 128
inline constexpr int kChunksPerRow = kRowBytes / 16;  // 8
inline constexpr int kATileBytes = kBlockM * kRowBytes;  // 8 KiB
inline constexpr int kBTileBytes = kBlockN * kRowBytes;  // 8 KiB
inline constexpr int kStageBytes = kATileBytes + kBTileBytes;
inline constexpr int kSmemBytes = kStages * kStageBytes;  // 96 KiB
inline constexpr int kMaxSplits = 256;  // as v3: 4 B per split, <= 1 KiB/row

static_assert(kWarpRows == 16, "one m16 fragment per warp");
static_assert(kBlockK % 16 == 0, "k16 steps");
static_assert(kChunksPerRow == 4 || kChunksPerRow == 8,
              "the swizzle handles 64- and 128-byte rows");
static_assert((kBlockM * kChunksPerRow) % kThreads == 0, "A copy split");
static_assert((kBlockN * kChunksPerRow) % kThreads == 0, "B copy split");
// 99 KiB is the opt-in maximum on sm_86/sm_89, the smallest of sm_80+.
static_assert(kSmemBytes <= 99 * 1024, "fits every sm_80+ GPU");

struct KernelParams {
  const __nv_bfloat16* hidden;   // [rows][hidden]
  const __nv_bfloat16* weight;   // [padded_vocab][hidden]
  const float* bias;             // [padded_vocab] or null
  const int32_t* targets;        // [rows], or null: targets64
  const int64_t* targets64;      // [rows] when targets is null
  const float* temperatures;     // [rows], or null: temperature
  float temperature;             // every row's, when temperatures is null
  float* logprobs;               // [rows]: z[target] here
  float* split_lse;              // [rows][num_splits]: logsumexp of split
  int64_t hidden_size;           // H, a multiple of 64
  int64_t padded_vocab;          // weight rows that may be read
  int32_t rows;
  int32_t k_blocks;              // H / kBlockK
  int32_t num_splits;
  int32_t num_row_blocks;
  int32_t split_begin[kMaxSplits + 1];  // split s is [begin[s], begin[s+1])
};

}  // namespace detlogp::kernels::cuda::portable_v1

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_PARAMS_CUH_
