// Kernel version sm90a-wgmma-bwd-v1: the batch-invariant backward of
// linear-logp for Hopper (sm_90a). Included by linear_logp_backward_cuda.cu
// only. Design and counts: docs/kernels.md, "Fused backward".
//
// For each vocabulary chunk of kChunkCols columns, in ascending order:
//   K1  G = dL/dlogits / T for the chunk, recomputed from hidden · W_cᵀ and
//       the forward's saved lse (GradLogitsEpilogue), stored as bf16
//       [rows][kChunkCols];
//   K2  dhidden (+)= G · W_c   (A = G K-major, B = W_c MN-major);
//   K3  dweight_c = Gᵀ · hidden (A = G MN-major, B = hidden MN-major);
//   and dbias_c as fixed-order column sums of G.
// All three are one persistent main loop (Gemm): 128 x 256 output tiles,
// K in 64-wide steps through a kStages-deep TMA ring, a producer warpgroup
// and two consumer warpgroups of 64 rows each (the forward kernel's
// structure, linear_logp_kernel.cuh). K2's and K3's epilogues hand their
// tiles to TMA through shared memory (Stager): K2 adds each chunk's product
// into the fp32 dhidden with a TMA reduce-add (one adder per element per
// launch, launches in stream order), so the consumers go on to the next
// tile instead of waiting for the earlier values to load. Every output
// element is one fixed K loop (k-blocks ascending, k16 steps ascending)
// with no split-K, so:
//   * a row's dhidden is the chunks' products folded in ascending chunk
//     order, each independent of the other rows and of N: batch invariant;
//   * dweight and dbias reduce over the rows in ascending order: the same
//     bits run to run (they depend on the batch, as the issue allows).
// The chunk width is a constant of this version: chunk boundaries never
// depend on N.
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_BACKWARD_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_BACKWARD_KERNEL_CUH_

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/hopper_ptx.cuh"

namespace detlogp::kernels::cuda::backward_v1 {

inline constexpr char kVersion[] = "sm90a-wgmma-bwd-v1";

inline constexpr int kBlockM = 128;
inline constexpr int kBlockN = 256;
inline constexpr int kBlockK = 64;   // 128 bytes of bf16: one swizzle row
inline constexpr int kMnBlock = 64;  // MN width of one MN-major TMA box
inline constexpr int kStages = 4;
inline constexpr int kConsumers = 2;
inline constexpr int kThreads = 128 * (1 + kConsumers);
inline constexpr int kATileBytes = kBlockM * kBlockK * 2;   // 16 KiB
inline constexpr int kBTileBytes = kBlockN * kBlockK * 2;   // 32 KiB
inline constexpr int kMnBoxBytes = kMnBlock * kBlockK * 2;  // 8 KiB
// Epilogue staging: per consumer, two buffers of 64 rows x 128 bytes (32
// fp32 or 64 bf16 columns), each handed to a TMA store while the next fills.
inline constexpr int kStageRows = 64;
inline constexpr int kStageBytes = kStageRows * 128;  // 8 KiB
inline constexpr int kStageBuffers = 2;
inline constexpr int kSmemBytes = kStages * (kATileBytes + kBTileBytes) +
                                  kConsumers * kStageBuffers * kStageBytes +
                                  2 * kStages * 8 + 1024;
inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;
// Vocabulary columns per chunk (G is [rows][kChunkCols] bf16).
inline constexpr int kChunkCols = 4096;
// Rows per fixed slice of the dbias column sums.
inline constexpr int kBiasSliceRows = 256;

// The output tile and K extent of one Gemm launch.
struct GemmShape {
  int32_t m;         // output rows
  int32_t n;         // output columns
  int32_t k_blocks;  // ceil(K / kBlockK); K past the operands reads zeros
  int32_t tiles_n;   // ceil(n / kBlockN); tiles = ceil(m / kBlockM) * tiles_n
  // Added to B's row coordinate (K-major B: K1's chunk start in W) or to
  // B's K coordinate (MN-major B over W: K2's chunk start).
  int32_t b_offset;
};

// K1's epilogue inputs: the forward's inputs and saved state, the upstream
// gradients ([rows] or null: zero) and the chunk.
struct GradLogitsParams {
  const float* bias;       // [padded_vocab] or null
  const int32_t* targets;  // [rows], or null: targets64
  const int64_t* targets64;
  const float* temperatures;  // [rows], or null: temperature
  float temperature;
  const float* lse;      // [rows] (the forward's)
  const float* entropy;  // [rows] or null (needed with grad_entropy)
  const float* grad_logprobs;
  const float* grad_lse;
  const float* grad_entropy;
  int32_t vocab_size;   // real V: columns >= V get G = 0
  int32_t chunk_begin;  // the chunk's first vocabulary id
  __nv_bfloat16* grad;  // [rows][kChunkCols]
};

// K2's and K3's epilogue: out = acc (+ what out holds, when accumulate).
// Each map covers the whole output with boxes of {128 bytes of columns,
// kStageRows rows} under the 128-byte swizzle; tile row r is map row
// row0 + r (rows past m are past the map's end too: only the last chunk is
// narrower than kChunkCols).
//   * plain store: fp32 to f32_map, or bf16 to bf16_map when bf16 is set;
//   * accumulate into fp32: a TMA reduce-add into f32_map;
//   * accumulate and round to bf16 (dhidden's last chunk): f32 read back
//     (the [m][ld] fp32 that f32_map covers), rounded to bf16 at `bf16`.
struct RowsOutParams {
  CUtensorMap f32_map;
  CUtensorMap bf16_map;
  const float* f32;     // [m][ld], read by the accumulate-and-round case
  __nv_bfloat16* bf16;  // [m][ld] or null
  int64_t ld;
  int32_t row0;
  int32_t accumulate;
};

using Ring = ptx::StageRing<kStages>;

// One consumer's staging buffers: an epilogue writes its 64-row tile piece
// by piece (128 bytes of columns each) into the next buffer and hands it to
// a TMA store or reduce-add, which runs on while the consumer goes on to the
// next piece and the next tile's main loop. A buffer is refilled only once
// the TMA that read it is done reading; Drain waits for every write.
class Stager {
 public:
  __device__ __forceinline__ Stager(uint8_t* buffers, int consumer, int tid)
      : buffers_(buffers), consumer_(consumer), leader_(tid == 0) {}

  // The buffer for the next piece (all 128 threads call it).
  __device__ __forceinline__ uint8_t* Acquire() {
    if (leader_) ptx::BulkWaitGroupRead<kStageBuffers - 1>();
    ptx::NamedBarrierSync(1 + consumer_, 128);
    return buffers_ + (piece_ % kStageBuffers) * kStageBytes;
  }

  // Stores (or, with reduce, adds) the filled buffer at (c0, c1) of `map`.
  __device__ __forceinline__ void Release(const CUtensorMap* map, int32_t c0,
                                          int32_t c1, bool reduce) {
    ptx::FenceProxyAsyncShared();
    ptx::NamedBarrierSync(1 + consumer_, 128);
    if (leader_) {
      const uint8_t* buffer = buffers_ + (piece_ % kStageBuffers) * kStageBytes;
      if (reduce) {
        ptx::TmaReduceAdd2d(map, buffer, c0, c1);
      } else {
        ptx::TmaStore2d(map, buffer, c0, c1);
      }
      ptx::BulkCommitGroup();
    }
    ++piece_;
  }

  // Warp `warp`'s 4 KiB of this consumer's buffers, for an epilogue that
  // stages without TMA (kStageBuffers * kStageBytes = 4 warps x 4 KiB).
  __device__ __forceinline__ uint8_t* WarpScratch(int warp) const {
    return buffers_ + warp * 4096;
  }

  __device__ __forceinline__ void Drain() {
    if (leader_) ptx::BulkWaitGroup<0>();
  }

 private:
  uint8_t* buffers_;
  int consumer_;
  bool leader_;
  int piece_ = 0;
};

// Where fragment row `row` (0..63), 16-byte chunk `chunk` of a staging
// buffer lives under the 128-byte swizzle (TMA's layout for 128-byte rows).
__device__ __forceinline__ uint8_t* StagedChunk(uint8_t* buffer, int row,
                                                int chunk) {
  return buffer + row * 128 + ((chunk ^ (row & 7)) << 4);
}

// The accumulator fragment of m64n256: thread `lane` of warp `warp` holds
// rows 16 * warp + lane / 4 (+ 8) and columns 8 * j + 2 * (lane % 4) (+ 1):
// acc[4 * j + 2 * h + e] is (row + 8 h, column + e).
__device__ __forceinline__ int FragmentRow(int warp, int lane, int h) {
  return 16 * warp + lane / 4 + 8 * h;
}
__device__ __forceinline__ int FragmentCol(int lane, int j) {
  return 8 * j + 2 * (lane % 4);
}

// -1 (no column) without targets: only grad_logprobs needs them.
__device__ __forceinline__ int RowTarget(const GradLogitsParams& p, int r) {
  if (p.targets != nullptr) return p.targets[r];
  if (p.targets64 == nullptr) return -1;
  const int64_t t = p.targets64[r];
  return (t >= 0 && t <= INT32_MAX) ? static_cast<int>(t) : -1;
}

__device__ __forceinline__ float LoadOr0(const float* p, int r) {
  return p != nullptr ? p[r] : 0.0f;
}

// G = dL/dz / T for z = (acc + bias) / T, with p = exp(z - lse):
// dL/dz_v = p_v (g_lse - g_logp - g_ent (z_v - lse + entropy)) + g_logp [v =
// t].
struct GradLogitsEpilogue {
  GradLogitsParams p;

  // The per-row inputs of the thread's two fragment rows, loaded by Begin
  // before the main loop so their latency hides behind it.
  struct State {
    float inv_t[2], lse[2], entropy[2], g_logp[2], g_ent[2], coef[2];
    int target[2];
  };

  __device__ __forceinline__ State Begin(float* /*acc*/, int m0, int /*n0*/,
                                         const GemmShape& shape, int consumer,
                                         int warp, int lane) const {
    State st{};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + 64 * consumer + FragmentRow(warp, lane, h);
      if (r >= shape.m) continue;
      const float temperature =
          p.temperatures != nullptr ? p.temperatures[r] : p.temperature;
      st.inv_t[h] = __frcp_rn(temperature);
      st.lse[h] = p.lse[r];
      st.entropy[h] = LoadOr0(p.entropy, r);
      st.g_logp[h] = LoadOr0(p.grad_logprobs, r);
      st.g_ent[h] = LoadOr0(p.grad_entropy, r);
      st.coef[h] = LoadOr0(p.grad_lse, r) - st.g_logp[h];
      st.target[h] = RowTarget(p, r);
    }
    return st;
  }

  // G leaves through a 4 KiB scratch of the warp's own (16 rows x 128
  // columns at a time): stmatrix writes the fragments' bf16 pairs, and each
  // lane then stores 16 bytes, so a warp's store covers whole 128-byte lines
  // (2 rows of 256 bytes) instead of half sectors of 8 rows. No barrier
  // beyond __syncwarp: the scratch belongs to the warp.
  __device__ __forceinline__ void Apply(float* acc, const State& st, int m0,
                                        int n0, const GemmShape& shape,
                                        int consumer, int warp, int lane,
                                        Stager& stager) const {
    uint8_t* scratch = stager.WarpScratch(warp);
    const uint32_t scratch_addr = ptx::SmemAddr(scratch);
    const int warp_row0 = m0 + 64 * consumer + 16 * warp;
    // stmatrix: lane l gives the address of row l % 8 of matrix l / 8, the
    // matrices being (h, j), (h + 1, j), (h, j + 1), (h + 1, j + 1).
    const int st_row = (lane & 7) + 8 * ((lane >> 3) & 1);
    const int st_chunk = lane >> 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int jj = 0; jj < 16; jj += 2) {
        uint32_t packed[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int h = q & 1;
          const int j = 16 * half + jj + (q >> 1);
          const int col = n0 + FragmentCol(lane, j);
          float g[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int v = p.chunk_begin + col + e;
            float y = acc[4 * j + 2 * h + e];
            if (p.bias != nullptr && col + e < shape.n) y += __ldg(p.bias + v);
            const float d = y * st.inv_t[h] - st.lse[h];
            const float prob = expf(d);
            float dz = prob * (st.coef[h] - st.g_ent[h] * (d + st.entropy[h]));
            if (v == st.target[h]) dz += st.g_logp[h];
            g[e] = v < p.vocab_size ? dz * st.inv_t[h] : 0.0f;
          }
          const __nv_bfloat162 pair = __floats2bfloat162_rn(g[0], g[1]);
          packed[q] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        const int chunk = jj + st_chunk;
        ptx::StMatrixX4(
            scratch_addr + st_row * 256 + ((chunk ^ (st_row & 7)) << 4),
            packed);
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int row = 2 * i + (lane >> 4);
        const int chunk = lane & 15;
        const uint4 v = *reinterpret_cast<const uint4*>(
            scratch + row * 256 + ((chunk ^ (row & 7)) << 4));
        const int r = warp_row0 + row;
        // Columns past n (the last chunk's) get zeros inside the row's
        // kChunkCols: no launch reads them.
        if (r < shape.m) {
          *reinterpret_cast<uint4*>(p.grad +
                                    static_cast<int64_t>(r) * kChunkCols + n0 +
                                    128 * half + 8 * chunk) = v;
        }
      }
      __syncwarp();
    }
  }
};

struct RowsOutEpilogue {
  RowsOutParams p;

  struct State {};

  __device__ __forceinline__ State Begin(float* /*acc*/, int /*m0*/, int /*n0*/,
                                         const GemmShape& /*shape*/,
                                         int /*consumer*/, int /*warp*/,
                                         int /*lane*/) const {
    return State{};
  }

  __device__ __forceinline__ void Apply(float* acc, const State& /*st*/, int m0,
                                        int n0, const GemmShape& shape,
                                        int consumer, int warp, int lane,
                                        Stager& stager) const {
    const int row0 = m0 + 64 * consumer;
    if (row0 >= shape.m) return;
    if (p.accumulate && p.bf16 != nullptr) {
      RoundSum(acc, m0, n0, shape, consumer, warp, lane);
      return;
    }
    if (p.bf16 != nullptr) {
      // bf16 pieces of 64 columns.
#pragma unroll
      for (int piece = 0; piece < kBlockN / 64; ++piece) {
        if (n0 + 64 * piece >= shape.n) break;
        uint8_t* buffer = stager.Acquire();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = FragmentRow(warp, lane, h);
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int j = 8 * piece + jj;
            *reinterpret_cast<__nv_bfloat162*>(StagedChunk(buffer, row, jj) +
                                               4 * (lane % 4)) =
                __floats2bfloat162_rn(acc[4 * j + 2 * h],
                                      acc[4 * j + 2 * h + 1]);
          }
        }
        stager.Release(&p.bf16_map, n0 + 64 * piece, p.row0 + row0, false);
      }
      return;
    }
    // fp32 pieces of 32 columns, stored or added.
#pragma unroll
    for (int piece = 0; piece < kBlockN / 32; ++piece) {
      if (n0 + 32 * piece >= shape.n) break;
      uint8_t* buffer = stager.Acquire();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = FragmentRow(warp, lane, h);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * piece + jj;
          *reinterpret_cast<float2*>(
              StagedChunk(buffer, row, 2 * jj + (lane % 4) / 2) +
              8 * (lane % 2)) =
              make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
      }
      stager.Release(&p.f32_map, n0 + 32 * piece, p.row0 + row0,
                     p.accumulate != 0);
    }
  }

 private:
  // out_bf16 = bf16(f32 + acc). Every earlier value is loaded before the
  // first store: the stores may alias the loads, so interleaved they would
  // serialise 64 round trips per thread (measured: K2 at 450 TFLOP/s, 590
  // without). (Loading them into the accumulators before the main loop
  // instead makes ptxas serialise the wgmma chain, C7515: measured slower.)
  __device__ __forceinline__ void RoundSum(float* acc, int m0, int n0,
                                           const GemmShape& shape, int consumer,
                                           int warp, int lane) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + 64 * consumer + FragmentRow(warp, lane, h);
      if (r >= shape.m) continue;
      const float* row = p.f32 + static_cast<int64_t>(r) * p.ld;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int col = n0 + FragmentCol(lane, j);
        if (col >= shape.n) continue;  // n is a multiple of 8: pairs whole
        const float2 prev = *reinterpret_cast<const float2*>(row + col);
        acc[4 * j + 2 * h] = prev.x + acc[4 * j + 2 * h];
        acc[4 * j + 2 * h + 1] = prev.y + acc[4 * j + 2 * h + 1];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + 64 * consumer + FragmentRow(warp, lane, h);
      if (r >= shape.m) continue;
      const int64_t base = static_cast<int64_t>(r) * p.ld;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int col = n0 + FragmentCol(lane, j);
        if (col >= shape.n) continue;
        *reinterpret_cast<__nv_bfloat162*>(p.bf16 + base + col) =
            __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
    }
  }
};

// C[m x n] = A[m x K] · B[n x K]ᵀ, then the epilogue. A K-major operand is
// loaded as one box of {kBlockK, rows}; an MN-major one as boxes of
// {kMnBlock, kBlockK}, kMnBoxBytes apart. Persistent: block b takes tiles
// b, b + gridDim.x, ... (n tiles fastest, so concurrent blocks share their A
// tile and the B operand stays in L2), and the producer runs on into the
// next tile's stages while the consumers finish a tile's epilogue. A tile's
// arithmetic does not depend on which block takes it.
template <bool kTransA, bool kTransB, class Epilogue>
__global__ void __launch_bounds__(kThreads, 1)
    Gemm(const __grid_constant__ CUtensorMap a_map,
         const __grid_constant__ CUtensorMap b_map,
         const __grid_constant__ GemmShape shape,
         const __grid_constant__ Epilogue epilogue) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem + kStages * kATileBytes;
  uint8_t* smem_stage = smem_b + kStages * kBTileBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(
      smem_stage + kConsumers * kStageBuffers * kStageBytes);
  uint64_t* empty = full + kStages;

  const int tiles = ((shape.m + kBlockM - 1) / kBlockM) * shape.tiles_n;
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if (threadIdx.x == 0) {
    ptx::PrefetchTensorMap(&a_map);
    ptx::PrefetchTensorMap(&b_map);
    for (int s = 0; s < kStages; ++s) {
      ptx::MbarInit(&full[s], 1);
      ptx::MbarInit(&empty[s], kConsumers * 4);
    }
    ptx::FenceBarrierInit();
  }
  __syncthreads();

  if (warpgroup == 0) {
    ptx::SetMaxNRegDec<kProducerRegs>();
    if (threadIdx.x != 0) return;
    Ring ring;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int m0 = (tile / shape.tiles_n) * kBlockM;
      const int n0 = (tile % shape.tiles_n) * kBlockN;
      for (int kb = 0; kb < shape.k_blocks; ++kb) {
        const int k = kb * kBlockK;
        ptx::MbarWait(&empty[ring.stage], ring.phase ^ 1u);
        // Out-of-bounds parts of a box are zero-filled and still counted.
        ptx::MbarArriveExpectTx(&full[ring.stage], kATileBytes + kBTileBytes);
        uint8_t* a = smem_a + ring.stage * kATileBytes;
        uint8_t* b = smem_b + ring.stage * kBTileBytes;
        if constexpr (kTransA) {
          for (int i = 0; i < kBlockM / kMnBlock; ++i) {
            ptx::TmaLoad2d(a + i * kMnBoxBytes, &a_map, &full[ring.stage],
                           m0 + i * kMnBlock, k);
          }
        } else {
          ptx::TmaLoad2d(a, &a_map, &full[ring.stage], k, m0);
        }
        if constexpr (kTransB) {
          for (int i = 0; i < kBlockN / kMnBlock; ++i) {
            ptx::TmaLoad2d(b + i * kMnBoxBytes, &b_map, &full[ring.stage],
                           n0 + i * kMnBlock, k + shape.b_offset);
          }
        } else {
          ptx::TmaLoad2d(b, &b_map, &full[ring.stage], k, n0 + shape.b_offset);
        }
        ring.Advance();
      }
    }
    return;
  }

  ptx::SetMaxNRegInc<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int tid = threadIdx.x & 127;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  float acc[kBlockN / 2];
  Stager stager(smem_stage + consumer * kStageBuffers * kStageBytes, consumer,
                tid);
  Ring ring;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int m0 = (tile / shape.tiles_n) * kBlockM;
    const int n0 = (tile % shape.tiles_n) * kBlockN;
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.0f;
    const typename Epilogue::State state =
        epilogue.Begin(acc, m0, n0, shape, consumer, warp, lane);
    int prev_stage = -1;
    for (int kb = 0; kb < shape.k_blocks; ++kb) {
      ptx::MbarWait(&full[ring.stage], ring.phase);
      // The consumer's 64 rows of A: rows 64c.. (K-major) or MN block c
      // (MN-major); both start kATileBytes / 2 into the stage.
      const uint32_t a_addr = ptx::SmemAddr(smem_a + ring.stage * kATileBytes +
                                            consumer * (kATileBytes / 2));
      const uint32_t b_addr = ptx::SmemAddr(smem_b + ring.stage * kBTileBytes);
      ptx::WgmmaFence();
#pragma unroll
      for (int k = 0; k < kBlockK / 16; ++k) {
        // K-major: +32 bytes per 16 k inside the swizzled row; MN-major: +16
        // rows of 128 bytes.
        const uint64_t da = kTransA ? ptx::MakeSmemDescSw128MnMajor(
                                          a_addr + k * 2048, kMnBoxBytes)
                                    : ptx::MakeSmemDescSw128(a_addr + k * 32);
        const uint64_t db = kTransB ? ptx::MakeSmemDescSw128MnMajor(
                                          b_addr + k * 2048, kMnBoxBytes)
                                    : ptx::MakeSmemDescSw128(b_addr + k * 32);
        ptx::WgmmaM64N256K16T<kTransA ? 1 : 0, kTransB ? 1 : 0>(acc, da, db,
                                                                (kb | k) != 0);
      }
      ptx::WgmmaCommit();
      ptx::WgmmaWait<1>();
      if (prev_stage >= 0 && lane == 0) ptx::MbarArrive(&empty[prev_stage]);
      prev_stage = ring.stage;
      ring.Advance();
    }
    ptx::WgmmaWait<0>();
    ptx::FenceAccumulators<kBlockN / 2>(acc);
    if (prev_stage >= 0 && lane == 0) ptx::MbarArrive(&empty[prev_stage]);
    epilogue.Apply(acc, state, m0, n0, shape, consumer, warp, lane, stager);
  }
  stager.Drain();
}

// dbias, step 1: column sums of G over fixed kBiasSliceRows-row slices, rows
// ascending. Grid: (ceil(cols / 256), slices); 256 threads, one column each.
__global__ void BiasPartialKernel(const __nv_bfloat16* grad, int32_t rows,
                                  int32_t cols, float* partial) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const int begin = blockIdx.y * kBiasSliceRows;
  const int end = min(rows, begin + kBiasSliceRows);
  float sum = 0.0f;
  for (int r = begin; r < end; ++r) {
    sum += __bfloat162float(grad[static_cast<int64_t>(r) * kChunkCols + col]);
  }
  partial[static_cast<int64_t>(blockIdx.y) * kChunkCols + col] = sum;
}

// dbias, step 2: the slices folded in ascending order; added to `out` when
// accumulate (a later row block).
__global__ void BiasFoldKernel(const float* partial, int32_t slices,
                               int32_t cols, int32_t accumulate, float* out) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float sum = 0.0f;
  for (int s = 0; s < slices; ++s) {
    sum += partial[static_cast<int64_t>(s) * kChunkCols + col];
  }
  out[col] = accumulate ? out[col] + sum : sum;
}

}  // namespace detlogp::kernels::cuda::backward_v1

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_BACKWARD_KERNEL_CUH_
