// Kernel version portable-mma-sync-v1: batch-invariant fused linear + online
// softmax split pass on mma.sync (issue #13). Uses only instructions every
// NVIDIA GPU from sm_80 on has: mma.sync.aligned.m16n8k16 (bf16 in, fp32
// accumulate), ldmatrix and cp.async. Self-contained (no Hopper PTX), so the
// same source builds for sm_80, sm_86, sm_89, sm_90 and compute_80 PTX.
// Included by linear_logp_portable.cu alone: the kernel's one translation
// unit, built for sm_80, sm_86, sm_89 and sm_90 machine code and compute_80
// PTX (kernels/cuda/BUILD); the launcher reaches it through
// linear_logp_portable.h. Tested bitwise on the H200 (forced there):
// tests/cuda/linear_logp_portable_test.cu.
//
// Contract (the same as v3, linear_logp_kernel.cuh):
//   * A work item is (row block of kBlockM = 128 rows, vocabulary split s),
//     one CTA per item (grid = row blocks x splits). Splits come from the
//     host's table (split_begin), in the batch-invariant mode
//     kernels/split_policy.h's VocabSplitRange(V, s), a function of V alone.
//   * A split [begin, end) is walked in ascending vocabulary order in
//     ceil((end - begin) / 128) tiles of 128 columns starting at begin; the
//     last tile's columns past `end` are masked to -inf (they may hold the
//     next split's rows or padding, which never count). The tiling depends
//     on the split boundaries alone, never on N or on the row position.
//   * Each logit is one mma.sync accumulation chain over k = 0, 16, ...,
//     H - 16 (a fixed K order; mma.sync computes every output element from
//     its own row and column only).
//   * 8 warps; warp w owns rows 16w..16w+15 of the block across the whole
//     128-column tile (16 n8 fragments, 64 fp32 accumulators per thread). A
//     thread holds two rows (lane / 4 and lane / 4 + 8), like a v3 consumer,
//     and the epilogue is v3's with W = 128: per-thread fold in fixed column
//     order, then a fixed xor-shuffle over the 4 lanes of the row's quad, then
//     the per-row online state (max, sum exp(z - max)) in ascending tile order.
//     No shared-memory or cross-warp reduction, no atomics.
//   * The split's state is written once per (row, split) as its logsumexp to
//     split_lse[row][split] (v3's partial format), folded by the shared
//     combine kernel (linear_logp_combine_kernel.cuh, compiled in the same
//     translation unit for the same architectures) in ascending split order.
//   * z = y * inv_t with y = acc + bias and inv_t = __frcp_rn(T), as in v3;
//     the thread that holds z[target] writes it to logprobs[row].
//   * Rows >= N and weight rows >= the padded vocabulary are zero-filled by
//     cp.async (never read out of bounds); warps whose 16 rows are all >= N
//     skip their mma and never write.
//   * Pipeline: kStages-deep cp.async ring of (A: 128 x kBlockK, B: 128 x
//     kBlockK) bf16 tiles, one __syncthreads per K step; the (tile, k-block)
//     steps of an item form one stream, so the ring runs across tiles.
//     Shared rows of 128 bytes (kBlockK = 64), 16-byte chunks XOR-swizzled
//     by row % 8 so that ldmatrix and cp.async hit distinct banks; 3 stages
//     (96 KiB, under sm_86/sm_89's 99 KiB) and registers capped so two CTAs
//     share an SM where it has the shared memory (sm_80, sm_90). The K depth
//     per step, the ring and the occupancy are schedule only: every logit is
//     the same mma chain and every fold the same order, so they keep the
//     version's bits (checked on the H200: tools/device/logp_portable_bench.py
//     digests equal for BK = 32 / 4 stages / one CTA per SM and this).
// Entropy and top-k are not implemented for this kernel (the host rejects
// them with UNIMPLEMENTED).
// Build flags matter for bits: -O3, no --use_fast_math / -ftz / -prec-div
// changes. Any change to the arithmetic or the tiling must bump kVersion.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_KERNEL_CUH_

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/linear_logp_portable_params.cuh"

namespace detlogp::kernels::cuda::portable_v1 {

// ------------------------------------------------------------------ PTX
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, zero-filled when !valid (src is then not read).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src,
                                          bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  static_assert(kPending >= 0 && kPending < 8, "cp.async.wait_group range");
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0,
                                           uint32_t& r1, uint32_t& r2,
                                           uint32_t& r3) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
      : "r"(addr)
      : "memory");  // never hoisted above the __syncthreads of its K step
}

// d += a * b for one m16n8k16 fragment (bf16 in, fp32 accumulate).
__device__ __forceinline__ void MmaM16N8K16(float* d, const uint32_t* a,
                                            uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Byte offset of 16-byte chunk `chunk` of shared row `row` in a tile: the
// chunk XOR-ed with the row's position among the rows sharing one 128-byte
// bank line, so the 8 rows an ldmatrix phase reads hit 8 distinct 16-byte
// bank groups.
__device__ __forceinline__ uint32_t Swizzle(int row, int chunk) {
  const int phase = kChunksPerRow == 8 ? (row & 7) : ((row >> 1) & 3);
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ phase) << 4));
}

// ------------------------------------------------------------------ helpers
// A row's target as the split pass compares it with its columns (as v3):
// int64 targets outside the int32 range become one no split holds.
__device__ __forceinline__ int RowTarget(const KernelParams& p, int r) {
  if (p.targets != nullptr) return p.targets[r];
  const int64_t t = p.targets64[r];
  return (t >= 0 && t <= INT32_MAX) ? static_cast<int>(t) : -(1 << 30);
}

__device__ __forceinline__ float RowTemperature(const KernelParams& p, int r) {
  return p.temperatures != nullptr ? p.temperatures[r] : p.temperature;
}

// Issues the cp.async copies of K step `step` of an item (tile step /
// k_blocks, k-block step % k_blocks) into ring slot `slot`.
__device__ __forceinline__ void LoadStep(const KernelParams& p, uint8_t* smem,
                                         int slot, int step, int row0,
                                         int begin) {
  const int tile = step / p.k_blocks;
  const int kb = step - tile * p.k_blocks;
  const int64_t k0 = static_cast<int64_t>(kb) * kBlockK;
  const int64_t v0 = begin + static_cast<int64_t>(tile) * kBlockN;
  uint8_t* a_tile = smem + slot * kStageBytes;
  uint8_t* b_tile = a_tile + kATileBytes;
  const uint32_t a_base = SmemAddr(a_tile);
  const uint32_t b_base = SmemAddr(b_tile);
#pragma unroll
  for (int i = 0; i < kBlockM * kChunksPerRow / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c / kChunksPerRow;
    const int chunk = c % kChunksPerRow;
    const int64_t r = row0 + row;
    const bool ok = r < p.rows;
    const __nv_bfloat16* src =
        ok ? p.hidden + r * p.hidden_size + k0 + chunk * 8 : p.hidden;
    CpAsync16(a_base + Swizzle(row, chunk), src, ok);
  }
#pragma unroll
  for (int i = 0; i < kBlockN * kChunksPerRow / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c / kChunksPerRow;
    const int chunk = c % kChunksPerRow;
    const int64_t v = v0 + row;
    const bool ok = v < p.padded_vocab;
    const __nv_bfloat16* src =
        ok ? p.weight + v * p.hidden_size + k0 + chunk * 8 : p.weight;
    CpAsync16(b_base + Swizzle(row, chunk), src, ok);
  }
}

// The mma of one K step for a warp's 16 rows x 128 columns.
__device__ __forceinline__ void ComputeStep(const uint8_t* smem, int slot,
                                            int warp, int lane, float* acc) {
  const uint8_t* a_tile = smem + slot * kStageBytes;
  const uint8_t* b_tile = a_tile + kATileBytes;
  const uint32_t a_base = SmemAddr(a_tile);
  const uint32_t b_base = SmemAddr(b_tile);
#pragma unroll
  for (int ks = 0; ks < kBlockK / 16; ++ks) {
    // A fragment: lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31 the
    // same rows at k 8-15 (ldmatrix matrices a0..a3 of m16n8k16).
    uint32_t a[4];
    {
      const int row = warp * kWarpRows + (lane & 15);
      const int chunk = ks * 2 + (lane >> 4);
      LdMatrixX4(a_base + Swizzle(row, chunk), a[0], a[1], a[2], a[3]);
    }
    // B fragments, two n8 fragments per ldmatrix.x4: matrices (n 0-7, k 0-7),
    // (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15). The weight is
    // [n][k] in shared memory, which is the "col" operand layout.
#pragma unroll
    for (int np = 0; np < kNFrags / 2; ++np) {
      const int n = np * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int chunk = ks * 2 + ((lane >> 3) & 1);
      uint32_t b0, b1, b2, b3;
      LdMatrixX4(b_base + Swizzle(n, chunk), b0, b1, b2, b3);
      MmaM16N8K16(acc + 4 * (2 * np), a, b0, b1);
      MmaM16N8K16(acc + 4 * (2 * np + 1), a, b2, b3);
    }
  }
}

struct RowState {
  float max;
  float sum;
};

// acc[4 * j + k] for a run-time j < kNFrags and k < 4, through a switch so
// that the accumulators stay in registers (an unrolled select chain was
// turned into a 256-byte local-memory array by ptxas), as v3 does.
__device__ __forceinline__ float SelectFragment(const float* acc, int j,
                                                int k) {
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  switch (j) {
#define DETLOGP_PORTABLE_CASE(J) \
  case J:                        \
    v[0] = acc[4 * J + 0];       \
    v[1] = acc[4 * J + 1];       \
    v[2] = acc[4 * J + 2];       \
    v[3] = acc[4 * J + 3];       \
    break;
    DETLOGP_PORTABLE_CASE(0) DETLOGP_PORTABLE_CASE(1)
    DETLOGP_PORTABLE_CASE(2) DETLOGP_PORTABLE_CASE(3)
    DETLOGP_PORTABLE_CASE(4) DETLOGP_PORTABLE_CASE(5)
    DETLOGP_PORTABLE_CASE(6) DETLOGP_PORTABLE_CASE(7)
    DETLOGP_PORTABLE_CASE(8) DETLOGP_PORTABLE_CASE(9)
    DETLOGP_PORTABLE_CASE(10) DETLOGP_PORTABLE_CASE(11)
    DETLOGP_PORTABLE_CASE(12) DETLOGP_PORTABLE_CASE(13)
    DETLOGP_PORTABLE_CASE(14) DETLOGP_PORTABLE_CASE(15)
#undef DETLOGP_PORTABLE_CASE
    default:
      break;
  }
  return k == 0 ? v[0] : (k == 1 ? v[1] : (k == 2 ? v[2] : v[3]));
}
static_assert(kNFrags == 16, "SelectFragment has 16 cases");

// Folds a finished 128-column tile starting at v0 (valid columns: `valid`,
// may exceed 128) into the thread's two rows' states; writes z[target].
// v3's epilogue with W = 128: y = acc + bias, tile max of z is
// fl(max(y) * inv_t), exp(z - m) = ex2(y * (inv_t * log2e) - m * log2e).
__device__ __forceinline__ void FoldTile(const KernelParams& p, float* acc,
                                         int lane, int v0, int valid,
                                         const int* row, const float* inv_t,
                                         const int* target, RowState* state) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int quad = lane & 3;
  const int limit = valid < kBlockN ? valid : kBlockN;
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < kNFrags; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * quad + e;
      const bool ok = col < limit;
      float b = 0.0f;
      if (p.bias != nullptr && ok) b = __ldg(p.bias + v0 + col);
      const float y0 = acc[4 * j + e] + b;
      const float y1 = acc[4 * j + 2 + e] + b;
      acc[4 * j + e] = ok ? y0 : -INFINITY;
      acc[4 * j + 2 + e] = ok ? y1 : -INFINITY;
      mx0 = fmaxf(mx0, acc[4 * j + e]);
      mx1 = fmaxf(mx1, acc[4 * j + 2 + e]);
    }
  }
  // The target logit: the one thread holding it writes z = y * inv_t.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int tcol = target[h] - v0;
    if (tcol >= 0 && tcol < limit && ((tcol >> 1) & 3) == quad) {
      const float y = SelectFragment(acc, tcol >> 3, 2 * h + (tcol & 1));
      p.logprobs[row[h]] = y * inv_t[h];
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float m0 = fmaxf(state[0].max, mx0 * inv_t[0]);
  const float m1 = fmaxf(state[1].max, mx1 * inv_t[1]);
  const float c0 = -m0 * kLog2e;
  const float c1 = -m1 * kLog2e;
  const float k0 = inv_t[0] * kLog2e;
  const float k1 = inv_t[1] * kLog2e;
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int j = 0; j < kNFrags; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s0 += Ex2(fmaf(acc[4 * j + e], k0, c0));
      s1 += Ex2(fmaf(acc[4 * j + 2 + e], k1, c1));
    }
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  const float r0 = Ex2((state[0].max - m0) * kLog2e);
  const float r1 = Ex2((state[1].max - m1) * kLog2e);
  state[0].sum = state[0].sum * r0 + s0;
  state[1].sum = state[1].sum * r1 + s1;
  state[0].max = m0;
  state[1].max = m1;
}

// One CTA per item: blockIdx.x = split * num_row_blocks + row_block (the
// row blocks of a split run together and share its weight rows in L2).
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    LinearLogpPortableSplitKernel(const __grid_constant__ KernelParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int item = blockIdx.x;
  const int split = item / p.num_row_blocks;
  const int row_block = item - split * p.num_row_blocks;
  const int begin = p.split_begin[split];
  const int end = p.split_begin[split + 1];
  const int tiles = (end - begin + kBlockN - 1) / kBlockN;
  const int steps = tiles * p.k_blocks;
  const int row0 = row_block * kBlockM;

  // Broadcast so that the compiler sees warp-uniform values.
  const int warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const int lane = threadIdx.x & 31;
  const bool active = row0 + warp * kWarpRows < p.rows;

  int row[2], target[2];
  float inv_t[2];
  RowState state[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + warp * kWarpRows + (lane >> 2) + 8 * h;
    row[h] = r;
    const bool in = r < p.rows;
    inv_t[h] = in ? __frcp_rn(RowTemperature(p, r)) : 1.0f;
    target[h] = in ? RowTarget(p, r) : -(1 << 30);
    state[h] = RowState{-INFINITY, 0.0f};
  }

  float acc[4 * kNFrags];
#pragma unroll
  for (int i = 0; i < 4 * kNFrags; ++i) acc[i] = 0.0f;

  // Prologue: steps 0 .. kStages-2 in flight (empty groups past the end keep
  // the group count uniform).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) LoadStep(p, smem, s, s, row0, begin);
    CpAsyncCommit();
  }
  for (int step = 0; step < steps; ++step) {
    CpAsyncWait<kStages - 2>();  // step's group has landed (this thread's)
    __syncthreads();             // ... every thread's; slot step-1 is free
    const int next = step + kStages - 1;
    if (next < steps) LoadStep(p, smem, next % kStages, next, row0, begin);
    CpAsyncCommit();
    if (active) ComputeStep(smem, step % kStages, warp, lane, acc);
    const int tile = step / p.k_blocks;
    if (step - tile * p.k_blocks == p.k_blocks - 1) {
      if (active) {
        const int v0 = begin + tile * kBlockN;
        FoldTile(p, acc, lane, v0, end - v0, row, inv_t, target, state);
      }
#pragma unroll
      for (int i = 0; i < 4 * kNFrags; ++i) acc[i] = 0.0f;
    }
  }
  CpAsyncWait<0>();

  if (active && (lane & 3) == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] < p.rows) {
        // The split's partial {max, sum} as its logsumexp (v3's format).
        const int64_t cell =
            static_cast<int64_t>(row[h]) * p.num_splits + split;
        p.split_lse[cell] = state[h].max + logf(state[h].sum);
      }
    }
  }
}

}  // namespace detlogp::kernels::cuda::portable_v1

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_PORTABLE_KERNEL_CUH_
