// The top-k floor kernel on its own
// (kernels/cuda/linear_logp_floor_kernel.cuh), against a float64 reference of
// the floor it promises: mean + sigmas deviations of z over the strided sample
// columns. The end-to-end tests cannot see a wrong floor (a floor changes a
// row's cost, never its bits), so a sample gathered in the wrong order, or a
// cluster adding the wrong partial sums, would only show as a slower top-k.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/cuda/linear_logp_floor_kernel.cuh"
#include "kernels/top_k_screen_key.h"
#include "tests/cuda/device_piece_test.cuh"

namespace detlogp::kernels::cuda::floors {
namespace {

using epilogue::kScreenWord;
using epilogue::kScreenWords;

using TopKFloors = ::detlogp::cuda_test::Sm90Test;
using ::detlogp::cuda_test::ToDevice;
using ::detlogp::cuda_test::ToHost;

struct Problem {
  int64_t hidden_size;
  int64_t vocab_size;
  int32_t rows;
  std::vector<uint16_t> hidden;  // bf16 bits, [rows][H]
  std::vector<uint16_t> weight;  // [V][H]
  std::vector<float> bias;       // [V]
  std::vector<float> temperatures;
};

Problem MakeProblem(int64_t hidden_size, int64_t vocab_size, int32_t rows,
                    uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> temperature(0.5f, 1.5f);
  Problem p{hidden_size, vocab_size, rows, {}, {}, {}, {}};
  // Rows of different scales and offsets, so that a row mixed up with
  // another shows.
  p.hidden.resize(static_cast<size_t>(rows) * hidden_size);
  for (int32_t r = 0; r < rows; ++r) {
    const float scale = 0.5f + 0.1f * static_cast<float>(r % 13);
    for (int64_t k = 0; k < hidden_size; ++k) {
      p.hidden[r * hidden_size + k] = FloatToBf16(scale * normal(rng));
    }
  }
  p.weight.resize(static_cast<size_t>(vocab_size) * hidden_size);
  for (uint16_t& x : p.weight) x = FloatToBf16(0.05f * normal(rng));
  p.bias.resize(vocab_size);
  for (float& x : p.bias) x = normal(rng);
  p.temperatures.resize(rows);
  for (float& x : p.temperatures) x = temperature(rng);
  return p;
}

// The floor the kernel promises for row r, in float64.
double ReferenceFloor(const Problem& p, int32_t r, float sigmas,
                      bool with_bias) {
  const int64_t stride = p.vocab_size / kSampleColumns;
  std::vector<double> z(kSampleColumns);
  double sum = 0.0;
  for (int j = 0; j < kSampleColumns; ++j) {
    const int64_t v = j * stride;
    double dot = 0.0;
    for (int64_t k = 0; k < p.hidden_size; ++k) {
      dot += static_cast<double>(Bf16ToFloat(p.hidden[r * p.hidden_size + k])) *
             Bf16ToFloat(p.weight[v * p.hidden_size + k]);
    }
    z[j] = (dot + (with_bias ? p.bias[v] : 0.0)) / p.temperatures[r];
    sum += z[j];
  }
  const double mean = sum / kSampleColumns;
  double sq = 0.0;
  for (double x : z) sq += (x - mean) * (x - mean);
  return mean + sigmas * std::sqrt(sq / (kSampleColumns - 1));
}

struct DeviceProblem {
  __nv_bfloat16* hidden = nullptr;
  __nv_bfloat16* weight = nullptr;
  float* bias = nullptr;
  float* temperatures = nullptr;
  uint4* sample = nullptr;
  float* sample_bias = nullptr;
  uint32_t* screen = nullptr;
  int32_t* rerun = nullptr;
  ~DeviceProblem() {
    for (void* ptr :
         {static_cast<void*>(hidden), static_cast<void*>(weight),
          static_cast<void*>(bias), static_cast<void*>(temperatures),
          static_cast<void*>(sample), static_cast<void*>(sample_bias),
          static_cast<void*>(screen), static_cast<void*>(rerun)}) {
      cudaFree(ptr);
    }
  }
};

constexpr int kPadRows = 16;  // screen rows past the batch
constexpr uint32_t kUntouched = 0xabababab;
constexpr int kBlockRows = 32;  // the split kernel's, as the test sets it
constexpr float kSigmas = 3.0f;

// What a floor launch wrote: the screens (kPadRows rows past the batch
// included) and the rerun marks, both filled with garbage beforehand.
struct FloorRun {
  std::vector<uint32_t> screen;
  std::vector<int32_t> rerun;
};

// Runs the gather and the floor kernel with k_splits blocks per cluster
// (sigmas 3, per-row temperatures, the bias if with_bias).
void RunFloors(const Problem& p, bool with_bias, int k_splits, FloorRun* out) {
  DeviceProblem d;
  d.hidden = reinterpret_cast<__nv_bfloat16*>(ToDevice(p.hidden));
  d.weight = reinterpret_cast<__nv_bfloat16*>(ToDevice(p.weight));
  d.bias = ToDevice(p.bias);
  d.temperatures = ToDevice(p.temperatures);
  ASSERT_EQ(cudaMalloc(&d.sample, p.hidden_size * 2 * kSampleColumns),
            cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d.sample_bias, kSampleColumns * sizeof(float)),
            cudaSuccess);
  ASSERT_EQ(
      EnqueueGatherSample(d.weight, with_bias ? d.bias : nullptr, p.hidden_size,
                          p.vocab_size, d.sample, d.sample_bias, nullptr),
      cudaSuccess);
  const int32_t row_blocks = (p.rows + kBlockRows - 1) / kBlockRows;
  const size_t screen_words =
      static_cast<size_t>(p.rows + kPadRows) * kScreenWords;
  d.screen = ToDevice(std::vector<uint32_t>(screen_words, kUntouched));
  d.rerun = ToDevice(std::vector<int32_t>(row_blocks + 1, -7));

  FloorParams f{};
  f.hidden = d.hidden;
  f.sample = d.sample;
  f.sample_bias = with_bias ? d.sample_bias : nullptr;
  f.temperatures = d.temperatures;
  f.temperature = 1.0f;
  f.hidden_size = p.hidden_size;
  f.rows = p.rows;
  f.k_splits = k_splits;
  f.sigmas = kSigmas;
  f.top_screen = d.screen;
  f.rerun_blocks = d.rerun;
  f.row_blocks = row_blocks;
  f.block_rows = kBlockRows;
  ASSERT_EQ(EnqueueFloorKernel(f, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out->screen = ToHost(d.screen, screen_words);
  out->rerun = ToHost(d.rerun, row_blocks + 1);
}

// Checks every screen word and rerun mark a floor launch owns.
void ExpectFloors(const Problem& p, bool with_bias, int k_splits) {
  SCOPED_TRACE(testing::Message()
               << "H " << p.hidden_size << " V " << p.vocab_size << " rows "
               << p.rows << " bias " << with_bias << " k_splits " << k_splits);
  FloorRun run;
  ASSERT_NO_FATAL_FAILURE(RunFloors(p, with_bias, k_splits, &run));
  const std::vector<uint32_t>& screen = run.screen;
  for (int32_t r = 0; r < p.rows; ++r) {
    const double want = ReferenceFloor(p, r, kSigmas, with_bias);
    const float got = ScreenValue(screen[r * kScreenWords + kScreenWord]);
    // fp32 sums of bf16 products against float64: a few ulps of the
    // row's scale.
    EXPECT_NEAR(got, want, 1e-4 * (1.0 + std::fabs(want))) << "row " << r;
    for (int word = 0; word < kScreenWords; ++word) {
      if (word != kScreenWord) {
        ASSERT_EQ(screen[r * kScreenWords + word], 0u)
            << "row " << r << " word " << word;
      }
    }
  }
  for (size_t i = static_cast<size_t>(p.rows) * kScreenWords; i < screen.size();
       ++i) {
    ASSERT_EQ(screen[i], kUntouched) << "word " << i << " past the batch";
  }
  for (int32_t v : run.rerun) EXPECT_EQ(v, 0);
}

TEST_F(TopKFloors, MatchFloat64ForEveryClusterSize) {
  // 37 rows: three tiles, the last one partial. At H = 256 half of a
  // 4-block cluster's 16 k parts have no k step; at 1088 they differ.
  for (int64_t hidden : {256, 1088}) {
    const Problem p = MakeProblem(hidden, 3001, 37, 11 + hidden);
    for (bool with_bias : {false, true}) {
      for (int k_splits : {1, 2, 4}) ExpectFloors(p, with_bias, k_splits);
    }
  }
}

TEST_F(TopKFloors, OneRowBatch) {
  const Problem p = MakeProblem(512, 256, 1, 5);
  for (int k_splits : {1, 4}) ExpectFloors(p, true, k_splits);
}

TEST_F(TopKFloors, NonFiniteRowsGetNoFloor) {
  Problem p = MakeProblem(256, 1000, 20, 9);
  const uint16_t nan = 0x7fc0;
  for (int64_t k = 0; k < p.hidden_size; ++k)
    p.hidden[3 * p.hidden_size + k] = nan;
  FloorRun run;
  ASSERT_NO_FATAL_FAILURE(
      RunFloors(p, /*with_bias=*/false, /*k_splits=*/2, &run));
  // 0 is below every float's key: the row screens nothing.
  EXPECT_EQ(run.screen[3 * kScreenWords + kScreenWord], 0u);
  EXPECT_GT(run.screen[4 * kScreenWords + kScreenWord], 0u);
}

TEST_F(TopKFloors, RejectsClusterSizesItCannotSplitRowsFor) {
  FloorParams f{};
  f.rows = 16;
  for (int k_splits : {0, 3, 5, 8}) {
    f.k_splits = k_splits;
    EXPECT_EQ(EnqueueFloorKernel(f, nullptr), cudaErrorInvalidValue)
        << k_splits;
  }
}

TEST(FloorKSplits, FillsTheSmsWhenTheBatchIsSmall) {
  EXPECT_EQ(FloorKSplits(1, 132), 4);
  EXPECT_EQ(FloorKSplits(33 * 16, 132), 4);
  EXPECT_EQ(FloorKSplits(34 * 16, 132), 2);
  EXPECT_EQ(FloorKSplits(1024, 132), 2);
  EXPECT_EQ(FloorKSplits(2048, 132), 1);
  EXPECT_EQ(FloorKSplits(4096, 132), 1);
}

}  // namespace
}  // namespace detlogp::kernels::cuda::floors
