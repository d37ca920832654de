// The top-k screens' device pieces on their own (kernels/cuda/
// linear_logp_topk.cuh), against host references: QuadKthOfSorted (the
// merge of a quad's four sorted lists), SlotBound's two kinds over a row's
// slots (a bound on the slots' k-th largest always, and exact where the
// kind promises it), and TileKthLowerBound over a tile's accumulators (a
// bound on the row's k-th largest value of the tile, and exactly the quad's
// least r-th best of its groups' two largest). A bound above the k-th largest
// would let a split drop a value of the row's top-k; the end-to-end tests would
// see that only on the rows and timings they happen to run.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "kernels/cuda/linear_logp_topk.cuh"
#include "kernels/top_k_screen_key.h"
#include "tests/cuda/device_piece_test.cuh"

namespace detlogp::kernels::cuda::epilogue {
namespace {

constexpr int kKept = 8;   // values a thread keeps (SlotBound's)
constexpr int kQuads = 8;  // quads in a warp
constexpr float kInf = INFINITY;

// Block b: one warp; thread t's sorted list is lists[b][t][0..8), and the
// k-th largest of quad q's 32 values (k = ks[b], the same for the warp, as
// in the kernels) goes to out[b][q].
__global__ void QuadKthKernel(const float* lists, const int* ks, float* out) {
  const int lane = threadIdx.x;
  float best[kKept];
#pragma unroll
  for (int i = 0; i < kKept; ++i) {
    best[i] = lists[(blockIdx.x * 32 + lane) * kKept + i];
  }
  const float kth = QuadKthOfSorted<kKept>(best, ks[blockIdx.x], lane);
  if ((lane & 3) == 0) out[blockIdx.x * kQuads + lane / 4] = kth;
}

// Block b: rows 8b .. 8b + 7, quad q reading row 8b + q.
template <SlotBoundKind kKind>
__global__ void SlotBoundKernel(TopKParams p, float* out) {
  const int lane = threadIdx.x;
  const int row = blockIdx.x * kQuads + lane / 4;
  const float bound = SlotBound<kKind>(p, row, lane);
  if ((lane & 3) == 0 && row < p.rows) out[row] = bound;
}

// Block b: one warp holding a tile of kW columns as the kernels do (thread
// t: kW / 2 accumulators, row h's at acc[4 j + 2 h + e]); the bound of quad
// q's row h goes to out[(b * kQuads + q) * 2 + h].
template <int kW>
__global__ void TileBoundKernel(const float* values, const int* ks,
                                float* out) {
  const int lane = threadIdx.x;
  float acc[kW / 2];
#pragma unroll
  for (int i = 0; i < kW / 2; ++i) {
    acc[i] = values[(blockIdx.x * 32 + lane) * (kW / 2) + i];
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float bound = TileKthLowerBound<kW>(acc, h, ks[blockIdx.x]);
    if ((lane & 3) == 0) out[(blockIdx.x * kQuads + lane / 4) * 2 + h] = bound;
  }
}

using TopKScreens = ::detlogp::cuda_test::Sm90Test;
using ::detlogp::cuda_test::ToDevice;
using ::detlogp::cuda_test::ToHost;

// The k-th largest of `values` (counted with repeats), -inf past the end.
float KthLargest(std::vector<float> values, int k) {
  std::sort(values.begin(), values.end(), std::greater<float>());
  return k <= static_cast<int>(values.size()) ? values[k - 1] : -kInf;
}

// Values with many ties and unset (-inf) entries: the cases a merge can
// get wrong.
float DrawValue(std::mt19937& rng) {
  static const float kPool[] = {-kInf, -kInf, -1.0f, 0.0f,
                                0.5f,  1.0f,  2.0f,  3.0f};
  std::uniform_int_distribution<int> pick(0, 15);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int i = pick(rng);
  return i < 8 ? kPool[i] : normal(rng);
}

TEST_F(TopKScreens, QuadKthOfSortedIsTheKthLargestOfTheQuad) {
  constexpr int kBlocks = 96;  // k = 1 .. 32, three times
  std::mt19937 rng(20261201);
  std::vector<float> lists(kBlocks * 32 * kKept);
  std::vector<int> ks(kBlocks);
  for (int b = 0; b < kBlocks; ++b) {
    ks[b] = 1 + b % 32;
    for (int t = 0; t < 32; ++t) {
      float* list = &lists[(b * 32 + t) * kKept];
      for (int i = 0; i < kKept; ++i) list[i] = DrawValue(rng);
      std::sort(list, list + kKept, std::greater<float>());
    }
  }
  float* d_lists = ToDevice(lists);
  int* d_ks = ToDevice(ks);
  float* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_out, kBlocks * kQuads * sizeof(float)), cudaSuccess);
  QuadKthKernel<<<kBlocks, 32>>>(d_lists, d_ks, d_out);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> out = ToHost(d_out, kBlocks * kQuads);
  for (int b = 0; b < kBlocks; ++b) {
    for (int q = 0; q < kQuads; ++q) {
      const auto first = lists.begin() + (b * 32 + 4 * q) * kKept;
      const std::vector<float> quad(first, first + 4 * kKept);
      EXPECT_EQ(out[b * kQuads + q], KthLargest(quad, ks[b]))
          << "block " << b << " quad " << q << " k " << ks[b];
    }
  }
  cudaFree(d_lists);
  cudaFree(d_ks);
  cudaFree(d_out);
}

// Rows of slots (unset: key 0) for both kinds, every k from 1 to 32.
TEST_F(TopKScreens, SlotBoundNeverExceedsTheSlotsKthLargest) {
  constexpr int kRows = 256;
  std::mt19937 rng(7);
  std::bernoulli_distribution unset(0.3);
  std::vector<uint32_t> screen(kRows * kScreenWords, 0u);
  std::vector<std::vector<float>> slots(kRows,
                                        std::vector<float>(kScreenSlots));
  for (int r = 0; r < kRows; ++r) {
    for (int s = 0; s < kScreenSlots; ++s) {
      const float v = unset(rng) ? -kInf : DrawValue(rng);
      slots[r][s] = v;
      screen[r * kScreenWords + s] = v == -kInf ? 0u : ScreenKey(v);
    }
  }
  uint32_t* d_screen = ToDevice(screen);
  float* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_out, kRows * sizeof(float)), cudaSuccess);
  for (int k = 1; k <= 32; ++k) {
    const TopKParams p{d_screen, k, 0, kRows};
    SlotBoundKernel<SlotBoundKind::kMerged><<<kRows / kQuads, 32>>>(p, d_out);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> merged = ToHost(d_out, kRows);
    SlotBoundKernel<SlotBoundKind::kQuadLeast>
        <<<kRows / kQuads, 32>>>(p, d_out);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> least = ToHost(d_out, kRows);
    for (int r = 0; r < kRows; ++r) {
      const float kth = KthLargest(slots[r], k);
      // The merge keeps each thread's 8 best of its 16 slots: exact unless
      // one thread holds more than 8 of the k best.
      std::vector<float> kept;
      float least_of_rth = kInf;
      const int rank = (k + 3) / 4;
      for (int q = 0; q < 4; ++q) {
        std::vector<float> own(slots[r].begin() + 16 * q,
                               slots[r].begin() + 16 * q + 16);
        std::sort(own.begin(), own.end(), std::greater<float>());
        kept.insert(kept.end(), own.begin(), own.begin() + kKept);
        least_of_rth = std::min(least_of_rth, own[rank - 1]);
      }
      EXPECT_LE(merged[r], kth) << "row " << r << " k " << k;
      EXPECT_LE(least[r], kth) << "row " << r << " k " << k;
      EXPECT_EQ(merged[r], KthLargest(kept, k)) << "row " << r << " k " << k;
      EXPECT_EQ(least[r], least_of_rth) << "row " << r << " k " << k;
    }
  }
  cudaFree(d_screen);
  cudaFree(d_out);
}

// Tiles of 32, 224 and 256 columns (1, 7 and 8 groups), every k from 1 to
// 32, values with ties and -inf (masked columns).
template <int kW>
void CheckTileBound() {
  constexpr int kBlocks = 64;  // k = 1 .. 32, twice
  constexpr int kGroups = kW / 32;
  std::mt19937 rng(kW);
  std::vector<float> values(kBlocks * 32 * (kW / 2));
  for (float& v : values) v = DrawValue(rng);
  std::vector<int> ks(kBlocks);
  for (int b = 0; b < kBlocks; ++b) ks[b] = 1 + b % 32;
  float* d_values = ToDevice(values);
  int* d_ks = ToDevice(ks);
  float* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_out, kBlocks * kQuads * 2 * sizeof(float)),
            cudaSuccess);
  TileBoundKernel<kW><<<kBlocks, 32>>>(d_values, d_ks, d_out);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> out = ToHost(d_out, kBlocks * kQuads * 2);
  for (int b = 0; b < kBlocks; ++b) {
    const int k = ks[b];
    const int rank = (k + 3) / 4;
    for (int q = 0; q < kQuads; ++q) {
      for (int h = 0; h < 2; ++h) {
        std::vector<float> row;  // the row's kW values in the tile
        float least = kInf;      // the quad's least r-th best of top-2s
        for (int t = 4 * q; t < 4 * q + 4; ++t) {
          const float* acc = &values[(b * 32 + t) * (kW / 2)];
          std::vector<float> top_two;
          for (int g = 0; g < kGroups; ++g) {
            std::vector<float> group;
            for (int j = 4 * g; j < 4 * g + 4; ++j) {
              for (int e = 0; e < 2; ++e)
                group.push_back(acc[4 * j + 2 * h + e]);
            }
            row.insert(row.end(), group.begin(), group.end());
            std::sort(group.begin(), group.end(), std::greater<float>());
            top_two.insert(top_two.end(), group.begin(), group.begin() + 2);
          }
          least = std::min(least, KthLargest(top_two, rank));
        }
        const float bound = out[(b * kQuads + q) * 2 + h];
        EXPECT_LE(bound, KthLargest(row, k)) << "block " << b << " k " << k;
        EXPECT_EQ(bound, least) << "block " << b << " quad " << q << " k " << k;
      }
    }
  }
  cudaFree(d_values);
  cudaFree(d_ks);
  cudaFree(d_out);
}

TEST_F(TopKScreens, TileBoundNeverExceedsTheTilesKthLargest) {
  CheckTileBound<32>();
  CheckTileBound<224>();
  CheckTileBound<256>();
}

}  // namespace
}  // namespace detlogp::kernels::cuda::epilogue
