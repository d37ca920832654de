// How fast one warpgroup's chain of wgmma.m64n256k16 runs against two
// warpgroups' chains side by side, on operands resident in shared memory:
// the question behind a ping-pong schedule for the linear-logp kernel
// (docs/performance.md, designs tried and rejected), where each consumer
// warpgroup multiplies alone while the other folds. Every wgmma of a chain
// adds into the same 128 accumulators, as in the kernel's K loop (four per
// 64-wide k block, commit, wait for all but the newest group).
// Built by Bazel (//tools/device:wgmma_rate_bench); on a Hopper GPU:
//   bash tools/device/run_suite.sh kernels   (or the bundle's
//   bin/wgmma_rate_bench alone). Prints TFLOP/s per mode, medians of 9
//   launches over every SM.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/cuda/hopper_ptx.cuh"

namespace ptx = detlogp::kernels::cuda::ptx;

namespace {

constexpr int kThreads = 384;              // warpgroup 0 idle, 1 and 2 multiply
constexpr int kATileBytes = 64 * 64 * 2;   // 64 rows x 64 k, bf16
constexpr int kBTileBytes = 256 * 64 * 2;  // 256 columns x 64 k
constexpr int kSmemBytes = 1024 + 2 * kATileBytes + kBTileBytes;

enum Mode : int {
  kTwoWarpgroups = 0,  // both multiply at once (the cooperative kernel)
  kOneWarpgroup = 1,   // warpgroup 1 alone (ping-pong, one turn)
  // Warpgroup 1 alone, each k step as two m64n128k16 into the two halves
  // of the accumulators: two independent chains (the same columns and
  // sums; whether their bits equal m64n256's is untested).
  kOneWarpgroupTwoChains = 2,
};

// The mode is a template parameter: a run-time branch between the two
// loops made ptxas serialise every wgmma (C7511).
template <int kMode>
__global__ void __launch_bounds__(kThreads, 1)
    WgmmaChains(int k_blocks, float* sink) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  // Finite, varied bf16 values (tensor-core power depends on the data).
  for (int i = threadIdx.x; i < (2 * kATileBytes + kBTileBytes) / 2;
       i += blockDim.x) {
    const float v =
        static_cast<float>((i * 2654435761u) >> 20) / 4096.0f - 0.5f;
    reinterpret_cast<__nv_bfloat16*>(smem)[i] = __float2bfloat16(v);
  }
  ptx::FenceProxyAsyncShared();
  __syncthreads();
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if (warpgroup == 0) return;
  if (kMode != kTwoWarpgroups && warpgroup == 2) return;
  const int consumer = warpgroup - 1;
  const uint64_t da =
      ptx::MakeSmemDescSw128(ptx::SmemAddr(smem + consumer * kATileBytes));
  const uint64_t db =
      ptx::MakeSmemDescSw128(ptx::SmemAddr(smem + 2 * kATileBytes));
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  // Columns 128..255 of B start 128 rows (16 KiB) further on.
  const uint64_t db_high = db + (16384 >> 4);
  for (int kb = 0; kb < k_blocks; ++kb) {
    ptx::WgmmaFence();
    if constexpr (kMode == kOneWarpgroupTwoChains) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ptx::WgmmaM64N128K16(acc, da + 2 * k, db + 2 * k, 1);
        ptx::WgmmaM64N128K16(acc + 64, da + 2 * k, db_high + 2 * k, 1);
      }
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ptx::WgmmaM64N256K16(acc, da + 2 * k, db + 2 * k, 1);
      }
    }
    ptx::WgmmaCommit();
    ptx::WgmmaWait<1>();
  }
  ptx::WgmmaWait<0>();
  ptx::FenceAccumulators<128>(acc);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 128; ++i) s += acc[i];
  if (s == 12345.0f) sink[threadIdx.x] = s;  // keeps the chain alive
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  void (*kernels[])(int, float*) = {WgmmaChains<kTwoWarpgroups>,
                                    WgmmaChains<kOneWarpgroup>,
                                    WgmmaChains<kOneWarpgroupTwoChains>};
  for (auto* kernel : kernels) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         kSmemBytes);
  }
  float* sink = nullptr;
  cudaMalloc(&sink, kThreads * sizeof(float));
  const int k_blocks = 16384;
  const char* names[] = {"two warpgroups at once", "one warpgroup alone",
                         "one, as two n128 chains"};
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int mode : {kTwoWarpgroups, kOneWarpgroup, kOneWarpgroupTwoChains,
                   kTwoWarpgroups, kOneWarpgroup, kOneWarpgroupTwoChains}) {
    std::vector<float> ms;
    for (int rep = 0; rep < 10; ++rep) {
      cudaEventRecord(start);
      kernels[mode]<<<prop.multiProcessorCount, kThreads, kSmemBytes>>>(
          k_blocks, sink);
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      float t = 0.0f;
      cudaEventElapsedTime(&t, start, stop);
      if (rep > 0) ms.push_back(t);  // the first launch warms up
    }
    std::sort(ms.begin(), ms.end());
    const double chains = mode == kTwoWarpgroups ? 2.0 : 1.0;
    const double flops = 2.0 * 64 * 256 * 16 * 4 *
                         static_cast<double>(k_blocks) * chains *
                         prop.multiProcessorCount;
    std::printf("%-24s %8.3f ms  %6.1f TFLOP/s\n", names[mode],
                ms[ms.size() / 2], flops / (ms[ms.size() / 2] * 1e-3) / 1e12);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
