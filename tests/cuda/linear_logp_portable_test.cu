// Tests of the portable mma.sync linear-logp kernel (KernelKind::kPortable,
// kernels/cuda/linear_logp_portable_kernel.cuh):
// accuracy against a float64 CPU reference and bitwise batch invariance
// (memcmp), as linear_logp_cuda_test.cu does for the Hopper kernel.
//
// The tests set the portable kernel beside the Hopper kernel, so they need an
// sm_90 GPU (the portable kernel is forced there); without one every test is
// skipped.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/cuda/linear_logp_cuda.h"
#include "kernels/split_policy.h"
#include "tests/cuda/linear_logp_extras_checks.cuh"
#include "tests/cuda/linear_logp_test_support.cuh"

namespace detlogp::kernels::cuda {
namespace {

std::unique_ptr<LinearLogpCuda> MakeKernel(
    const Weights& w, KernelKind kernel = KernelKind::kPortable,
    SplitMode mode = SplitMode::kBatchInvariant) {
  return MakeKernelOf(kernel, w, mode);
}

// ------------------------------------------------------------------ tests
TEST(LinearLogpPortableVersion, VersionAndInstructionSet) {
  REQUIRE_SM90();
  auto w = MakeWeights(64, 65, 65, /*bias=*/false);
  auto portable = MakeKernel(*w);
  auto hopper = MakeKernel(*w, KernelKind::kHopper);
  ASSERT_NE(portable, nullptr);
  ASSERT_NE(hopper, nullptr);
  EXPECT_STREQ(portable->kernel_version(), "portable-mma-sync-v1");
  EXPECT_STREQ(LinearLogpCuda::KernelVersion(KernelKind::kPortable),
               "portable-mma-sync-v1");
  // The Hopper kernel's identity is unchanged.
  EXPECT_STREQ(LinearLogpCuda::KernelVersion(), "sm90a-wgmma-v3");
  EXPECT_STREQ(hopper->kernel_version(), "sm90a-wgmma-v3");
  EXPECT_EQ(hopper->instruction_set(), "sm_90a");
  // The H200 loads the build's own sm_90 cubin (no JIT, no driver version).
  EXPECT_EQ(portable->instruction_set(), "sm_90/sass_sm_90");
  auto on_device = LinearLogpCuda::InstructionSetOn(KernelKind::kPortable, 0);
  ASSERT_TRUE(on_device.ok()) << on_device.status();
  EXPECT_EQ(*on_device, portable->instruction_set());
  EXPECT_EQ(*LinearLogpCuda::InstructionSetOn(KernelKind::kHopper, 0),
            "sm_90a");
  EXPECT_EQ(portable->NumSplits(1), NumVocabSplits(65));
  EXPECT_EQ(portable->WorkspaceBytes(10), hopper->WorkspaceBytes(10));
}

// Its own suite name, so the logs tell the two kernels' runs apart.
class PortableFullVocabTest : public FullVocabTest {};

TEST_F(PortableFullVocabTest, ProbeRowAloneEqualsRowAtAnyPositionAndChunking) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_);
  ASSERT_NE(k, nullptr);
  const int64_t N = 2048, H = 4096;
  auto batch = MakeBatch(N, H, weights_->V);
  const int64_t positions[] = {0, 15, 16, 63, 64, 127, 128, 255, 2047};
  const int64_t src = 2000;
  for (int64_t p : positions) {
    std::memcpy(&batch->host_hidden[p * H], &batch->host_hidden[src * H],
                H * 2);
    batch->host_targets[p] = batch->host_targets[src];
    batch->host_temps[p] = batch->host_temps[src];
  }
  batch->Upload();

  const Result full = RunRows(*k, *batch, 0, N);
  ExpectAccurate(*weights_, *batch, full, 0, {0, 1, 2, 129, 2000, 2047});
  if (::testing::Test::HasFailure()) return;  // wrong values: bits are moot
  const Result alone = RunRows(*k, *batch, src, 1);
  ExpectRowBits(alone, 0, full, src, "alone vs in batch");
  for (int64_t p : positions)
    ExpectRowBits(alone, 0, full, p, "probe position");

  // Single rows for the first 300 (every row position of the first blocks),
  // then chunkings whose block boundaries fall elsewhere.
  for (int64_t r = 0; r < 300; ++r) {
    const Result one = RunRows(*k, *batch, r, 1);
    ExpectRowBits(one, 0, full, r, "single row vs full");
  }
  for (int64_t chunk : {7, 16, 33, 64, 127, 128, 129, 256, 257, 1000}) {
    for (int64_t start = 0; start < N; start += chunk) {
      const int64_t count = std::min(chunk, N - start);
      const Result part = RunRows(*k, *batch, start, count);
      for (int64_t i = 0; i < count; ++i) {
        ExpectRowBits(part, i, full, start + i, "chunked vs full");
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST_F(PortableFullVocabTest, TwoStreamsAndRepeatedRunsAgree) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_);
  ASSERT_NE(k, nullptr);
  ExpectTwoStreamsAndRepeatsAgree(*k, *weights_);
}

// Not bitwise (other instructions, other fold order): both kernels agree
// to the accuracy each has against float64.
TEST_F(PortableFullVocabTest, AgreesWithTheHopperKernel) {
  REQUIRE_SM90();
  auto portable = MakeKernel(*weights_);
  auto hopper = MakeKernel(*weights_, KernelKind::kHopper);
  ASSERT_NE(portable, nullptr);
  ASSERT_NE(hopper, nullptr);
  const int64_t N = 257;
  auto batch = MakeBatch(N, 4096, weights_->V);
  const Result a = RunRows(*portable, *batch, 0, N);
  const Result b = RunRows(*hopper, *batch, 0, N);
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_LE(std::fabs(a.logprobs[i] - b.logprobs[i]), 2e-3) << "row " << i;
    EXPECT_LE(std::fabs(a.lse[i] - b.lse[i]), 2e-3) << "row " << i;
  }
}

TEST_F(PortableFullVocabTest, ThroughputSplitIsAccurate) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_, KernelKind::kPortable, SplitMode::kThroughput);
  ASSERT_NE(k, nullptr);
  auto batch = MakeBatch(300, 4096, weights_->V);
  const Result r = RunRows(*k, *batch, 0, 300);
  ExpectAccurate(*weights_, *batch, r, 0, {0, 1, 150, 299});
}

struct ShapeCase {
  int64_t V, Vpad, H;
  bool bias;
  bool unit_temperature;
};

// Every V edge with every H edge; padding, bias and temperature vary with
// the case index so that each appears with several shapes.
std::vector<ShapeCase> EdgeCases() {
  std::vector<ShapeCase> cases;
  int i = 0;
  for (int64_t V : {1, 63, 64, 65, 4097, 151936}) {
    for (int64_t H : {64, 128, 4096}) {
      const int64_t Vpad =
          i % 3 == 0 ? V : (V + 127) / 128 * 128 + 64 * (i % 3);
      cases.push_back(ShapeCase{V, Vpad, H, i % 2 == 0, i % 4 == 1});
      ++i;
    }
  }
  return cases;
}

class PortableShapeTest : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(PortableShapeTest, AccurateAndBatchInvariant) {
  REQUIRE_SM90();
  const ShapeCase c = GetParam();
  auto w = MakeWeights(c.H, c.V, c.Vpad, c.bias);
  auto k = MakeKernel(*w);
  ASSERT_NE(k, nullptr);
  const int64_t N = 300;
  auto batch = MakeBatch(N, c.H, c.V, c.unit_temperature);
  const Result full = RunRows(*k, *batch, 0, N);
  // Reference rows: all for small problems, a sample for large ones.
  std::vector<int64_t> rows;
  const int64_t work = c.V * c.H;
  const int64_t step =
      work <= (int64_t{1} << 20) ? 1 : (work <= (int64_t{1} << 24) ? 13 : 97);
  for (int64_t r = 0; r < N; r += step) rows.push_back(r);
  rows.push_back(N - 1);
  ExpectAccurate(*w, *batch, full, 0, rows);
  for (int64_t r : {0, 1, 15, 16, 63, 64, 127, 128, 130, 299}) {
    const Result alone = RunRows(*k, *batch, r, 1);
    ExpectRowBits(alone, 0, full, r, "alone vs batch");
  }
  const Result tail = RunRows(*k, *batch, 200, 100);
  for (int64_t i = 0; i < 100; ++i)
    ExpectRowBits(tail, i, full, 200 + i, "tail");
  const Result pair = RunRows(*k, *batch, 17, 256);
  for (int64_t i = 0; i < 256; ++i)
    ExpectRowBits(pair, i, full, 17 + i, "pair");
}

INSTANTIATE_TEST_SUITE_P(Edges, PortableShapeTest,
                         ::testing::ValuesIn(EdgeCases()),
                         [](const ::testing::TestParamInfo<ShapeCase>& info) {
                           const ShapeCase& c = info.param;
                           return "V" + std::to_string(c.V) + "_Vpad" +
                                  std::to_string(c.Vpad) + "_H" +
                                  std::to_string(c.H) +
                                  (c.bias ? "_bias" : "_nobias") +
                                  (c.unit_temperature ? "_T1" : "_Trand");
                         });

// LaunchSplits of the portable kernel, then its LaunchCombine (the combine
// compiled with the portable kernel, KernelKind::kPortable), equals
// Launch bit for bit; so do vocabulary shards of the portable kernel, their
// partials assembled in ascending split order and folded once.
TEST(LinearLogpPortablePartials, FoldThroughLaunchCombine) {
  REQUIRE_SM90();
  for (auto [H, V, Vpad] :
       {std::tuple<int64_t, int64_t, int64_t>{256, 20000, 20032},
        {128, 4097, 4097},
        {64, 151936, 152064}}) {
    auto w = MakeWeights(H, V, Vpad, /*bias=*/true);
    auto batch = MakeBatch(300, H, V);
    const int64_t n = batch->N;
    auto k = MakeKernel(*w);
    ASSERT_NE(k, nullptr);
    const Result want = RunRows(*k, *batch, 0, n);

    // Unsharded: split pass, then the combine.
    const int32_t splits = k->NumSplits(n);
    ASSERT_EQ(splits, NumVocabSplits(V));
    DevBuf<float> part(n * splits), z(n), lse(n);
    LinearLogpBatchView view{batch->hidden.ptr, batch->targets.ptr,
                             batch->temps.ptr,  z.ptr,
                             nullptr,           n};
    ASSERT_TRUE(k->LaunchSplits(view, SplitPartials{part.ptr}, nullptr).ok());
    LinearLogpBatchView outputs;
    outputs.logprobs = z.ptr;
    outputs.lse = lse.ptr;
    outputs.rows = n;
    ASSERT_TRUE(LinearLogpCuda::LaunchCombine(SplitPartials{part.ptr}, splits,
                                              outputs, 0, nullptr,
                                              KernelKind::kPortable)
                    .ok());
    CUDA_OK(cudaDeviceSynchronize());
    const Result folded{z.ToHost(), lse.ToHost()};
    EXPECT_EQ(0,
              std::memcmp(folded.logprobs.data(), want.logprobs.data(), n * 4));
    EXPECT_EQ(0, std::memcmp(folded.lse.data(), want.lse.data(), n * 4));

    // Shards.
    for (int shards : {2, 3}) {
      std::vector<float> split_lse(n * splits);
      std::vector<float> zt(n, std::nanf(""));
      for (int g = 0; g < shards; ++g) {
        const int32_t first = splits * g / shards;
        const int32_t end = splits * (g + 1) / shards;
        const int64_t row0 = VocabSplitRange(V, first).begin;
        const int64_t row1 = VocabSplitRange(V, end - 1).end;
        DevBuf<__nv_bfloat16> shard_w((row1 - row0) * H);
        DevBuf<float> shard_b(row1 - row0);
        CUDA_OK(cudaMemcpy(shard_w.ptr, w->w.ptr + row0 * H,
                           (row1 - row0) * H * 2, cudaMemcpyDeviceToDevice));
        CUDA_OK(cudaMemcpy(shard_b.ptr, w->b.ptr + row0, (row1 - row0) * 4,
                           cudaMemcpyDeviceToDevice));
        LinearLogpCuda::Options options;
        options.weights =
            LinearLogpWeightsView{shard_w.ptr, shard_b.ptr, H, V, row1 - row0};
        options.first_split = first;
        options.end_split = end;
        options.kernel = KernelKind::kPortable;
        auto shard = LinearLogpCuda::Create(options);
        ASSERT_TRUE(shard.ok()) << shard.status();
        std::vector<int32_t> local(n);
        for (int64_t r = 0; r < n; ++r) {
          local[r] = static_cast<int32_t>(batch->host_targets[r] - row0);
        }
        DevBuf<int32_t> local_targets(n);
        local_targets.FromHost(local);
        DevBuf<float> shard_part((end - first) * n), shard_z(n);
        CUDA_OK(cudaMemset(shard_z.ptr, 0xFF, n * 4));
        LinearLogpBatchView sv{batch->hidden.ptr, local_targets.ptr,
                               batch->temps.ptr,  shard_z.ptr,
                               nullptr,           n};
        const absl::Status s =
            (*shard)->LaunchSplits(sv, SplitPartials{shard_part.ptr}, nullptr);
        ASSERT_TRUE(s.ok()) << s;
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> ph = shard_part.ToHost(),
                                 zh = shard_z.ToHost();
        for (int64_t r = 0; r < n; ++r) {
          for (int32_t sp = first; sp < end; ++sp) {
            split_lse[r * splits + sp] = ph[r * (end - first) + (sp - first)];
          }
          if (batch->host_targets[r] >= row0 && batch->host_targets[r] < row1) {
            zt[r] = zh[r];
          }
        }
      }
      DevBuf<float> all(n * splits), lp2(n), lse2(n);
      all.FromHost(split_lse);
      lp2.FromHost(zt);
      LinearLogpBatchView out2;
      out2.logprobs = lp2.ptr;
      out2.lse = lse2.ptr;
      out2.rows = n;
      ASSERT_TRUE(LinearLogpCuda::LaunchCombine(SplitPartials{all.ptr}, splits,
                                                out2, 0, nullptr,
                                                KernelKind::kPortable)
                      .ok());
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(0,
                std::memcmp(lp2.ToHost().data(), want.logprobs.data(), n * 4))
          << shards << " shards, V=" << V;
      EXPECT_EQ(0, std::memcmp(lse2.ToHost().data(), want.lse.data(), n * 4))
          << shards << " shards, V=" << V;
    }
  }
}

TEST(LinearLogpPortableInputs, Int64TargetsAndScalarTemperatureKeepTheBits) {
  REQUIRE_SM90();
  ExpectInt64TargetsAndScalarTemperatureKeepBits(KernelKind::kPortable);
}

// ------------------------------------------------------------ entropy, top-k
// The Hopper kernel's checks (tests/cuda/linear_logp_extras_checks.cuh).
TEST_F(PortableFullVocabTest, ExtrasNeverChangeLogprobBits) {
  REQUIRE_SM90();
  ExpectExtrasNeverChangeLogprobBits(*weights_, KernelKind::kPortable);
}

TEST_F(PortableFullVocabTest, ExtrasOfARowAloneEqualTheRowAnywhere) {
  REQUIRE_SM90();
  ExpectExtrasOfARowAloneEqualTheRowAnywhere(*weights_, KernelKind::kPortable);
}

TEST(LinearLogpPortableExtras, SmallVocabulariesAndPadding) {
  REQUIRE_SM90();
  ExpectExtrasOfSmallVocabulariesAndPadding(KernelKind::kPortable);
}

TEST(LinearLogpPortableExtras, FlatAndPeakedRows) {
  REQUIRE_SM90();
  ExpectExtrasOfFlatAndPeakedRows(KernelKind::kPortable);
}

TEST(LinearLogpPortableExtras, RejectsBadTopK) {
  REQUIRE_SM90();
  ExpectBadTopKRejected(KernelKind::kPortable);
}

}  // namespace
}  // namespace detlogp::kernels::cuda
