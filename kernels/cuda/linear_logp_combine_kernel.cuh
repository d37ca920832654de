// The fold of the split partials both linear-logp kernels write (v3's
// partial format: each split's logsumexp, and for the extras its entropy sum
// and top-k list), in ascending split order. Shared by the Hopper kernel
// (linear_logp_cuda.cu, sm_90a) and the portable kernel
// (linear_logp_portable.cu, sm_80..sm_90 + compute_80 PTX): each translation
// unit compiles its own copy for its own architectures (the kernel has
// internal linkage), so the fold a split kernel's partials go through is
// built exactly like the split kernel, and its bits are covered by the same
// determinism key (kernel version + instruction set).
// Build flags matter for bits: no --use_fast_math / -ftz / -prec-div changes
// (expf/logf).
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_KERNEL_CUH_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_KERNEL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/linear_logp_combine_params.h"
#include "kernels/cuda/linear_logp_topk.cuh"
#include "kernels/lm_head.h"
#include "kernels/softmax_partial.h"

namespace detlogp::kernels::cuda::combine {

// Programmatic dependent launch (sm_90 on; no-ops before, and in a grid
// launched without the attribute): the primary lets its dependent start
// early, and the dependent waits for the primary to finish and its writes
// to be visible before it reads them.
__device__ __forceinline__ void LetDependentGridStart() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void WaitForPrimaryGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A rerun pass (p.only_blocks) computes only the rows of marked blocks:
// the others' outputs are final (their logprobs no longer hold z).
__device__ __forceinline__ bool LeavesRowAlone(const CombineParams& p, int r) {
  return p.only_blocks != nullptr && p.only_blocks[r / p.block_rows] == 0;
}

// Folds row r's split partials ({lse_s, 1}) in ascending split order with
// CombinePartials, starting from split 0, and finishes
// logprob = z[target] - lse; the entropy sums fold alongside with the same
// rescaling. One thread per row: the fold order is fixed and independent of
// the launch shape.
static __global__ void CombineKernel(const __grid_constant__ CombineParams p) {
  LetDependentGridStart();  // the top-k merge needs the lse only at its end
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.rows || LeavesRowAlone(p, r)) return;
  const int64_t first = static_cast<int64_t>(r) * p.num_splits;
  const float* row = p.split_lse + first;
  SoftmaxPartial acc{row[0], 1.0f};
  float sum_exp_z = p.split_mean_z != nullptr ? p.split_mean_z[first] : 0.0f;
  for (int s = 1; s < p.num_splits; ++s) {
    const SoftmaxPartial next{row[s], 1.0f};
    if (p.split_mean_z != nullptr) {
      sum_exp_z =
          CombineEntropySums(EntropyPartial{acc, sum_exp_z},
                             EntropyPartial{next, p.split_mean_z[first + s]},
                             fmaxf(acc.max, next.max));
    }
    acc = CombinePartials(acc, next);
  }
  const float l = PartialLogSumExp(acc);
  p.lse[r] = l;
  float z_target = p.logprobs[r];
  if (p.targets != nullptr || p.targets64 != nullptr) {
    const int64_t t = p.targets != nullptr ? p.targets[r] : p.targets64[r];
    if (t < 0 || t >= p.vocab_size) z_target = NAN;
  }
  p.logprobs[r] = z_target - l;
  if (p.entropy != nullptr) p.entropy[r] = PartialEntropy(acc, sum_exp_z, l);
}

// Top-k, after CombineKernel on the same stream (it reads p.lse, so the
// logprob fold is the same kernel with or without top-k): one warp per row
// merges the per-split lists into one, lane i holding entry i (k <= 32).
// Each split's candidates are screened at once against the list's worst
// entry and the survivors inserted one at a time by the whole warp (a ballot
// finds the place, a shuffle moves the tail). The k best under RanksBefore
// (a total order) are one set whatever order candidates arrive in, so this
// equals a sequential merge bit for bit. Launched as CombineKernel's
// programmatic dependent, it merges beside the lse fold and waits for it
// (WaitForPrimaryGrid) only to finish the log-probs: one after the other
// they took ~29 + ~21 us at N = 1024 (docs/kernels.md, "Top-k lists").
static __global__ void CombineTopKKernel(
    const __grid_constant__ CombineParams p) {
  const int r = static_cast<int>(
      (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32);
  const int lane = threadIdx.x & 31;
  if (r >= p.rows || LeavesRowAlone(p, r)) return;  // warp-uniform
  const int k = p.top_k;
  const bool holds = lane < k;
  float best_z = -INFINITY;  // empty entries rank after every real one
  int32_t best_id = -1;
  const int64_t first = static_cast<int64_t>(r) * p.num_splits * k;
  // kAhead splits' entries are loaded before any is merged: the merge is
  // short (most lists hold nothing the screen lets through), the loads are
  // not.
  constexpr int kAhead = 8;
  for (int s0 = 0; s0 < p.num_splits; s0 += kAhead) {
    float zs[kAhead];
    int32_t ids[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t at = first + static_cast<int64_t>(s0 + u) * k + lane;
      const bool load = holds && s0 + u < p.num_splits;
      zs[u] = load ? p.split_top_z[at] : -INFINITY;
      ids[u] = load ? p.split_top_id[at] : -1;
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const float z = zs[u];
      const int32_t id = ids[u];
      const float worst_z = __shfl_sync(0xffffffffu, best_z, k - 1);
      const int32_t worst_id = __shfl_sync(0xffffffffu, best_id, k - 1);
      unsigned pass = __ballot_sync(
          0xffffffffu, id >= 0 && RanksBefore(z, id, worst_z, worst_id));
      while (pass != 0) {  // warp-uniform
        const int src = __ffs(pass) - 1;
        pass &= pass - 1;
        const float cz = __shfl_sync(0xffffffffu, z, src);
        const int32_t cid = __shfl_sync(0xffffffffu, id, src);
        const int place = __popc(__ballot_sync(
            0xffffffffu, holds && RanksBefore(best_z, best_id, cz, cid)));
        const float above_z = __shfl_up_sync(0xffffffffu, best_z, 1);
        const int32_t above_id = __shfl_up_sync(0xffffffffu, best_id, 1);
        if (place < k) {  // warp-uniform: the candidate makes the list
          if (lane == place) {
            best_z = cz;
            best_id = cid;
          } else if (lane > place) {
            best_z = above_z;
            best_id = above_id;
          }
        }
      }
    }
  }
  // Only a floor above the row's k-th best leaves an entry empty (k <= V):
  // the row's block runs again, the row with a cleared screen.
  if (p.mark_blocks != nullptr &&
      __shfl_sync(0xffffffffu, best_id, k - 1) < 0) {  // warp-uniform
    if (lane == 0) {
      p.mark_blocks[r / p.block_rows] = 1;
      p.mark_blocks[p.row_blocks] = 1;
    }
    for (int w = lane; w < epilogue::kScreenWords; w += 32) {
      p.top_screen[static_cast<int64_t>(r) * epilogue::kScreenWords + w] = 0u;
    }
  }
  WaitForPrimaryGrid();
  if (holds) {
    const float l = p.lse[r];
    const int64_t out = static_cast<int64_t>(r) * k + lane;
    p.top_ids[out] = best_id;
    p.top_logprobs[out] = best_id >= 0 ? best_z - l : -INFINITY;
  }
}

// Enqueues this translation unit's combine for p.rows rows (and its top-k
// merge when p.top_ids is set). dependent_launch: the merge is launched as
// CombineKernel's programmatic dependent (cudaLaunchKernelEx; the device
// must support it, sm_90 on), so that the two run side by side; otherwise
// after it.
static inline cudaError_t EnqueueCombineKernels(const CombineParams& p,
                                                cudaStream_t stream,
                                                bool dependent_launch) {
  constexpr int kThreads = 128;
  CombineKernel<<<static_cast<unsigned>((p.rows + kThreads - 1) / kThreads),
                  kThreads, 0, stream>>>(p);
  if (p.top_ids == nullptr) return cudaGetLastError();
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  cudaLaunchConfig_t config = {};
  const int64_t threads = static_cast<int64_t>(p.rows) * 32;
  config.gridDim =
      dim3(static_cast<unsigned>((threads + kThreads - 1) / kThreads));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  if (dependent_launch) {
    config.attrs = overlap;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, CombineTopKKernel, p);
}

}  // namespace detlogp::kernels::cuda::combine

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_COMBINE_KERNEL_CUH_
