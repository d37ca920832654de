// Bitwise batch-invariance and accuracy tests for the CUDA fused linear-logp
// kernel. Needs an sm_90 (Hopper) device. Equality is always memcmp on the
// output bits; accuracy is against a float64 CPU reference on the same bf16
// inputs. Every run draws fresh random data (the seed is printed).
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
    const Weights& w, SplitMode mode = SplitMode::kBatchInvariant) {
  return MakeKernelOf(KernelKind::kHopper, w, mode);
}

// ------------------------------------------------------------------ tests

TEST(LinearLogpCudaVersion, HasVersion) {
  REQUIRE_SM90();
  EXPECT_STREQ(LinearLogpCuda::KernelVersion(), "sm90a-wgmma-v3");
}

TEST_F(FullVocabTest, ProbeRowAloneEqualsRowAtAnyPositionAndChunking) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_);
  ASSERT_NE(k, nullptr);
  const int64_t N = 4096, H = 4096;
  auto batch = MakeBatch(N, H, weights_->V);
  // The probe: row 4000's data copied to the probe positions.
  const int64_t positions[] = {0, 63, 64, 127, 128, 255, 4095};
  const int64_t src = 4000;
  for (int64_t p : positions) {
    std::memcpy(&batch->host_hidden[p * H], &batch->host_hidden[src * H],
                H * 2);
    batch->host_targets[p] = batch->host_targets[src];
    batch->host_temps[p] = batch->host_temps[src];
  }
  batch->Upload();

  const Result full = RunRows(*k, *batch, 0, N);
  const Result alone = RunRows(*k, *batch, src, 1);
  ExpectRowBits(alone, 0, full, src, "alone vs in batch");
  for (int64_t p : positions)
    ExpectRowBits(alone, 0, full, p, "probe position");

  for (int64_t chunk : {1, 7, 255, 256, 257}) {
    for (int64_t start = 0; start < N; start += chunk) {
      const int64_t count = std::min(chunk, N - start);
      const Result part = RunRows(*k, *batch, start, count);
      for (int64_t i = 0; i < count; ++i) {
        ExpectRowBits(part, i, full, start + i, "chunked vs full");
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
  ExpectAccurate(*weights_, *batch, full, 0, {0, 1, 2, 129, 4095});
}

// 33 row blocks, the last one partial; compared to 257-row chunks (other
// block boundaries) and to single rows.
TEST_F(FullVocabTest, OddRowBlockCountWithClustersMatchesChunks) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_);
  ASSERT_NE(k, nullptr);
  const int64_t N = 33 * 128 - 5;
  auto batch = MakeBatch(N, 4096, weights_->V);
  const Result full = RunRows(*k, *batch, 0, N);
  for (int64_t start = 0; start < N; start += 257) {
    const int64_t count = std::min<int64_t>(257, N - start);
    const Result part = RunRows(*k, *batch, start, count);
    for (int64_t i = 0; i < count; ++i) {
      ExpectRowBits(part, i, full, start + i, "257-chunk vs 33 blocks");
    }
  }
  for (int64_t r : {int64_t{0}, int64_t{4095}, int64_t{4096}, N - 1}) {
    const Result alone = RunRows(*k, *batch, r, 1);
    ExpectRowBits(alone, 0, full, r, "alone vs 33 blocks");
  }
}

TEST_F(FullVocabTest, TwoStreamsAndRepeatedRunsAgree) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_);
  ASSERT_NE(k, nullptr);
  ExpectTwoStreamsAndRepeatsAgree(*k, *weights_);
}

TEST_F(FullVocabTest, ConcurrentLaunchesFromSeveralHostThreads) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_);
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->NumSplits(1), k->NumSplits(4096));  // a function of V alone
  EXPECT_LE(k->WorkspaceBytes(1000), size_t{1000} * 1024);
  const int64_t N = 333;
  auto batch = MakeBatch(N, 4096, weights_->V);
  const Result ref = RunRows(*k, *batch, 0, N);
  constexpr int kThreads = 4;
  std::vector<Result> got(kThreads);
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      cudaStream_t s;
      CUDA_CHECK_THROW(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      for (int rep = 0; rep < 3; ++rep) got[t] = RunRows(*k, *batch, 0, N, s);
      CUDA_CHECK_THROW(cudaStreamDestroy(s));
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(std::memcmp(got[t].logprobs.data(), ref.logprobs.data(), N * 4),
              0);
    EXPECT_EQ(std::memcmp(got[t].lse.data(), ref.lse.data(), N * 4), 0);
  }
}

TEST_F(FullVocabTest, ThroughputSplitIsAccurate) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_, SplitMode::kThroughput);
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

class ShapeTest : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(ShapeTest, AccurateAndBatchInvariant) {
  REQUIRE_SM90();
  const ShapeCase c = GetParam();
  auto w = MakeWeights(c.H, c.V, c.Vpad, c.bias);
  auto k = MakeKernel(*w);
  ASSERT_NE(k, nullptr);
  const int64_t N = 300;
  auto batch = MakeBatch(N, c.H, c.V, c.unit_temperature);
  const Result full = RunRows(*k, *batch, 0, N);
  for (int64_t r : {0, 1, 63, 64, 130, 299}) {
    const Result alone = RunRows(*k, *batch, r, 1);
    ExpectRowBits(alone, 0, full, r, "alone vs batch");
  }
  const Result tail = RunRows(*k, *batch, 200, 100);
  for (int64_t i = 0; i < 100; ++i)
    ExpectRowBits(tail, i, full, 200 + i, "tail");
  // 256 rows starting at an odd offset: two full row blocks whose rows sit at
  // other positions (and in other blocks) than in the 300-row batch.
  const Result pair = RunRows(*k, *batch, 17, 256);
  for (int64_t i = 0; i < 256; ++i)
    ExpectRowBits(pair, i, full, 17 + i, "pair");
  // Reference rows: all for small problems, a sample for large ones.
  std::vector<int64_t> rows;
  const int64_t work = c.V * c.H;
  const int64_t step =
      work <= (int64_t{1} << 20) ? 1 : (work <= (int64_t{1} << 24) ? 13 : 97);
  for (int64_t r = 0; r < N; r += step) rows.push_back(r);
  rows.push_back(N - 1);
  ExpectAccurate(*w, *batch, full, 0, rows);
}

INSTANTIATE_TEST_SUITE_P(
    Edges, ShapeTest,
    ::testing::Values(ShapeCase{63, 63, 64, true, false},
                      ShapeCase{64, 64, 128, false, false},
                      ShapeCase{65, 128, 8192, true, false},
                      ShapeCase{1, 1, 64, true, false},
                      ShapeCase{129, 192, 320, true, true},
                      ShapeCase{2049, 2049, 576, true, false},
                      ShapeCase{4097, 4097, 4096, false, false},
                      ShapeCase{4097, 4160, 2112, true, false},
                      ShapeCase{8191, 8256, 8192, true, false},
                      ShapeCase{151936, 151936, 64, true, false},
                      ShapeCase{151936, 152064, 1024, false, true}),
    [](const ::testing::TestParamInfo<ShapeCase>& info) {
      const ShapeCase& c = info.param;
      return "V" + std::to_string(c.V) + "_Vpad" + std::to_string(c.Vpad) +
             "_H" + std::to_string(c.H) + (c.bias ? "_bias" : "_nobias") +
             (c.unit_temperature ? "_T1" : "_Trand");
    });

// Vocabulary parallelism: shards holding contiguous split ranges (here on
// one GPU, in separate allocations, as on separate GPUs), their partials
// assembled in ascending split order and folded once, equal the unsharded
// kernel bit for bit.
Result RunSharded(const Weights& w, const Batch& batch, int shards) {
  const int32_t splits = NumVocabSplits(w.V);
  const int64_t n = batch.N;
  std::vector<float> split_lse(n * splits);
  std::vector<float> z(n, std::nanf(""));
  for (int g = 0; g < shards; ++g) {
    const int32_t first = splits * g / shards;
    const int32_t end = splits * (g + 1) / shards;
    const int64_t row0 = VocabSplitRange(w.V, first).begin;
    const int64_t row1 = VocabSplitRange(w.V, end - 1).end;
    // The shard's own copy of its rows, as a GPU of its own would hold.
    DevBuf<__nv_bfloat16> shard_w((row1 - row0) * w.H);
    DevBuf<float> shard_b(row1 - row0);
    CUDA_CHECK_THROW(cudaMemcpy(shard_w.ptr, w.w.ptr + row0 * w.H,
                                (row1 - row0) * w.H * 2,
                                cudaMemcpyDeviceToDevice));
    CUDA_CHECK_THROW(cudaMemcpy(shard_b.ptr, w.b.ptr + row0, (row1 - row0) * 4,
                                cudaMemcpyDeviceToDevice));
    LinearLogpCuda::Options options;
    options.weights = LinearLogpWeightsView{
        shard_w.ptr, w.has_bias ? shard_b.ptr : nullptr, w.H, w.V, row1 - row0};
    options.first_split = first;
    options.end_split = end;
    auto shard = LinearLogpCuda::Create(options);
    EXPECT_TRUE(shard.ok()) << shard.status();
    if (!shard.ok()) return {};
    EXPECT_EQ((*shard)->NumSplits(n), end - first);
    EXPECT_EQ((*shard)->ShardBegin(), row0);
    std::vector<int32_t> local(n);
    for (int64_t r = 0; r < n; ++r) {
      local[r] = static_cast<int32_t>(batch.host_targets[r] - row0);
    }
    DevBuf<int32_t> local_targets(n);
    local_targets.FromHost(local);
    DevBuf<float> part((end - first) * n), shard_z(n);
    CUDA_CHECK_THROW(cudaMemset(shard_z.ptr, 0xFF, n * 4));
    LinearLogpBatchView view{batch.hidden.ptr, local_targets.ptr,
                             batch.temps.ptr,  shard_z.ptr,
                             nullptr,          n};
    const absl::Status s =
        (*shard)->LaunchSplits(view, SplitPartials{part.ptr}, nullptr);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_FALSE((*shard)->Launch(view, part.ptr, nullptr).ok());
    CUDA_CHECK_THROW(cudaDeviceSynchronize());
    const std::vector<float> part_host = part.ToHost();
    const std::vector<float> z_host = shard_z.ToHost();
    for (int64_t r = 0; r < n; ++r) {
      for (int32_t sp = first; sp < end; ++sp) {
        split_lse[r * splits + sp] =
            part_host[r * (end - first) + (sp - first)];
      }
      if (batch.host_targets[r] >= row0 && batch.host_targets[r] < row1) {
        z[r] = z_host[r];
      }
    }
  }
  DevBuf<float> all(n * splits), lp(n), lse(n);
  all.FromHost(split_lse);
  lp.FromHost(z);
  LinearLogpBatchView outputs;
  outputs.logprobs = lp.ptr;
  outputs.lse = lse.ptr;
  outputs.rows = n;
  const absl::Status s = LinearLogpCuda::LaunchCombine(
      SplitPartials{all.ptr}, splits, outputs, 0, nullptr);
  EXPECT_TRUE(s.ok()) << s;
  CUDA_CHECK_THROW(cudaDeviceSynchronize());
  return Result{lp.ToHost(), lse.ToHost()};
}

TEST(LinearLogpCudaShards, ShardedSplitsEqualTheUnshardedKernel) {
  REQUIRE_SM90();
  for (auto [H, V, Vpad] :
       {std::tuple<int64_t, int64_t, int64_t>{256, 20000, 20032},
        {128, 4097, 4097},
        {64, 151936, 152064}}) {
    auto w = MakeWeights(H, V, Vpad, /*bias=*/true);
    auto batch = MakeBatch(300, H, V);
    LinearLogpCuda::Options options;
    options.weights = w->View();
    auto full = LinearLogpCuda::Create(options);
    ASSERT_TRUE(full.ok()) << full.status();
    const Result reference = RunRows(**full, *batch, 0, batch->N);
    for (int shards : {2, 3, 5}) {
      const Result sharded = RunSharded(*w, *batch, shards);
      ASSERT_EQ(sharded.logprobs.size(), reference.logprobs.size());
      EXPECT_EQ(0,
                std::memcmp(sharded.logprobs.data(), reference.logprobs.data(),
                            reference.logprobs.size() * 4))
          << shards << " shards, V=" << V;
      EXPECT_EQ(0, std::memcmp(sharded.lse.data(), reference.lse.data(),
                               reference.lse.size() * 4))
          << shards << " shards, V=" << V;
    }
  }
}

TEST(LinearLogpCudaShards, RejectsBadShardRanges) {
  REQUIRE_SM90();
  auto w = MakeWeights(64, 4097, 4097, false);
  for (auto [first, end] : {std::pair{-1, 3}, {3, 3}, {0, 1000}}) {
    LinearLogpCuda::Options options;
    options.weights = w->View();
    options.first_split = first;
    options.end_split = end;
    EXPECT_FALSE(LinearLogpCuda::Create(options).ok()) << first << ".." << end;
  }
}

// The extras' memory target: they need at most 1 KiB per row plus
// k * 8 bytes per row and split for the top-k lists, at every split count
// the batch-invariant policy gives (at most 132: kernels/split_policy.h).
TEST(LinearLogpCudaWorkspace, ExtrasFitTheMemoryTarget) {
  for (int64_t rows : {1, 64, 4097}) {
    for (int32_t splits : {1, 17, 132}) {
      for (bool entropy : {false, true}) {
        for (int32_t top_k : {0, 1, 20, 32}) {
          const size_t extra =
              LinearLogpCuda::PartialsBytes(rows, splits, entropy, top_k) -
              LinearLogpCuda::PartialsBytes(rows, splits, false, 0);
          const size_t lists = static_cast<size_t>(rows) * splits * top_k * 8;
          EXPECT_LE(extra, lists + static_cast<size_t>(rows) * 1024)
              << "rows " << rows << " splits " << splits << " entropy "
              << entropy << " top_k " << top_k;
        }
      }
    }
  }
}

// Every partial PartitionWorkspace hands out lies inside the bytes
// PartialsBytes counts, the top-k screens 16-byte aligned, for any 4-byte
// aligned workspace (host arithmetic only: runs without a GPU too).
TEST(LinearLogpCudaWorkspace, PartitionFitsPartialsBytes) {
  for (int64_t rows : {1, 7, 64, 1000, 4097}) {
    for (int32_t splits : {1, 17, 132, 256}) {
      for (bool entropy : {false, true}) {
        for (int32_t top_k : {0, 1, 20, 32}) {
          const size_t bytes =
              LinearLogpCuda::PartialsBytes(rows, splits, entropy, top_k);
          std::vector<uint32_t> block(bytes / 4 + 8);
          for (size_t skew : {0, 4, 8, 12}) {
            char* base = reinterpret_cast<char*>(block.data()) + skew;
            const SplitPartials p = LinearLogpCuda::PartitionWorkspace(
                base, rows, splits, entropy, top_k);
            const size_t cells = static_cast<size_t>(rows) * splits;
            auto inside = [&](const void* at, size_t extent) {
              const char* c = static_cast<const char*>(at);
              return c >= base && c + extent <= base + bytes;
            };
            SCOPED_TRACE(testing::Message()
                         << "rows " << rows << " splits " << splits
                         << " entropy " << entropy << " top_k " << top_k
                         << " skew " << skew);
            EXPECT_TRUE(inside(p.lse, cells * 4));
            EXPECT_EQ(p.mean_z != nullptr, entropy);
            if (entropy) EXPECT_TRUE(inside(p.mean_z, cells * 4));
            EXPECT_EQ(p.top_screen != nullptr, top_k > 0);
            if (top_k > 0) {
              EXPECT_TRUE(inside(p.top_z, cells * top_k * 4));
              EXPECT_TRUE(inside(p.top_ids, cells * top_k * 4));
              EXPECT_TRUE(inside(p.top_screen,
                                 rows * LinearLogpCuda::kTopKScreenRowBytes));
              EXPECT_EQ(reinterpret_cast<uintptr_t>(p.top_screen) % 16, 0u);
              EXPECT_GE(
                  reinterpret_cast<const char*>(p.top_screen),
                  reinterpret_cast<const char*>(p.top_ids + cells * top_k));
            }
          }
        }
      }
    }
  }
}

TEST(LinearLogpCudaValidation, RejectsInvalidSizes) {
  REQUIRE_SM90();
  DevBuf<__nv_bfloat16> w(256 * 128);
  DevBuf<float> bias(256);
  auto make = [&](const __nv_bfloat16* wp, int64_t H, int64_t V, int64_t Vp) {
    LinearLogpCuda::Options o;
    o.weights = LinearLogpWeightsView{wp, bias.ptr, H, V, Vp};
    return LinearLogpCuda::Create(o);
  };
  EXPECT_FALSE(make(w.ptr, 100, 64, 64).ok());  // H not a multiple of 64
  EXPECT_FALSE(make(w.ptr, 0, 64, 64).ok());
  EXPECT_FALSE(make(w.ptr, -64, 64, 64).ok());
  EXPECT_FALSE(make(w.ptr, 128, 0, 0).ok());     // empty vocabulary
  EXPECT_FALSE(make(w.ptr, 128, 128, 64).ok());  // Vpad < V
  EXPECT_FALSE(make(nullptr, 128, 64, 64).ok());
  EXPECT_FALSE(make(w.ptr + 1, 128, 64, 64).ok());  // misaligned weight
  auto ok = make(w.ptr, 128, 200, 256);
  ASSERT_TRUE(ok.ok()) << ok.status();
  const LinearLogpCuda& k = **ok;
  EXPECT_LE(k.WorkspaceBytes(1000), size_t{1000} * 1024);

  DevBuf<__nv_bfloat16> h(4 * 128 + 8);
  DevBuf<int32_t> t(4);
  DevBuf<float> temp(4), lp(4), lse(4);
  DevBuf<uint8_t> ws(k.WorkspaceBytes(4));
  LinearLogpBatchView good{h.ptr, t.ptr, temp.ptr, lp.ptr, lse.ptr, 4};
  LinearLogpBatchView v = good;
  v.rows = -1;
  EXPECT_FALSE(k.Launch(v, ws.ptr, nullptr).ok());
  v = good;
  v.hidden = nullptr;
  EXPECT_FALSE(k.Launch(v, ws.ptr, nullptr).ok());
  v = good;
  v.hidden = h.ptr + 1;  // misaligned
  EXPECT_FALSE(k.Launch(v, ws.ptr, nullptr).ok());
  v = good;
  v.lse = nullptr;
  EXPECT_FALSE(k.Launch(v, ws.ptr, nullptr).ok());
  EXPECT_FALSE(k.Launch(good, nullptr, nullptr).ok());
  v = good;
  v.rows = 0;
  EXPECT_TRUE(k.Launch(v, nullptr, nullptr).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The trainer-side inputs (kernels/capi): int64 targets read in place and one
// temperature for every row give the bits of int32 targets and a [rows]
// array; a target outside [0, V) gives a NaN logprob (its lse still exact)
// with no prefilled output.
TEST(LinearLogpCudaInputs, Int64TargetsAndScalarTemperatureKeepTheBits) {
  REQUIRE_SM90();
  ExpectInt64TargetsAndScalarTemperatureKeepBits(KernelKind::kHopper);
}

// ------------------------------------------------------------ entropy, top-k
// (tests/cuda/linear_logp_extras_checks.cuh, shared with the portable kernel)
TEST_F(FullVocabTest, ExtrasNeverChangeLogprobBits) {
  REQUIRE_SM90();
  ExpectExtrasNeverChangeLogprobBits(*weights_, KernelKind::kHopper);
}

TEST_F(FullVocabTest, ExtrasOfARowAloneEqualTheRowAnywhere) {
  REQUIRE_SM90();
  ExpectExtrasOfARowAloneEqualTheRowAnywhere(*weights_, KernelKind::kHopper);
}

// Every k gives the same ranking: a row's top-k for k = 31, 30, 24, 20, 2
// are prefixes of its top-32, bit for bit, though each k screens its
// candidates against different bounds and its lists fill in a different
// order (a change to how survivors reach the lists must keep this).
TEST_F(FullVocabTest, TopKOfEveryKIsAPrefixOfTheLargest) {
  REQUIRE_SM90();
  auto k = MakeKernel(*weights_);
  ASSERT_NE(k, nullptr);
  auto batch = MakeBatch(1100, weights_->H, weights_->V);
  const Extras largest = RunExtras(*k, *batch, 0, batch->N, false, 32);
  for (int32_t top_k : {31, 30, 24, 20, 2}) {
    const Extras smaller = RunExtras(*k, *batch, 0, batch->N, false, top_k);
    for (int64_t i = 0; i < batch->N; ++i) {
      ExpectSameExtras(largest, i, smaller, i, "k " + std::to_string(top_k));
    }
  }
  ExpectExtrasAccurate(*weights_, *batch, largest, 0, {0, 640, 1099});
}

// Small vocabularies: splits narrower than k, one split, padding rows with
// huge logits that must never be chosen, bias and temperature.
TEST(LinearLogpCudaExtras, SmallVocabulariesAndPadding) {
  REQUIRE_SM90();
  ExpectExtrasOfSmallVocabulariesAndPadding(KernelKind::kHopper);
}

TEST(LinearLogpCudaExtras, FlatAndPeakedRows) {
  REQUIRE_SM90();
  ExpectExtrasOfFlatAndPeakedRows(KernelKind::kHopper);
}

TEST(LinearLogpCudaExtras, RejectsBadTopK) {
  REQUIRE_SM90();
  ExpectBadTopKRejected(KernelKind::kHopper);
}

// Top-k floors (linear_logp_floor_kernel.cuh) are a speed knob. With them
// off, at their default, and so high that every row comes out short and its
// row block runs again, every output has the same bits (floors forced on
// for batches of any size).
TEST_F(FullVocabTest, TopKFloorsNeverChangeBits) {
  REQUIRE_SM90();
  auto batch = MakeBatch(3 * 128 + 5, weights_->H, weights_->V);
  auto make = [&](bool floors, float sigmas) {
    return MakeKernelWith(*weights_, [&](LinearLogpCuda::Options& o) {
      o.top_k_floors = floors;
      o.top_k_floor_sigmas = sigmas;
      o.top_k_floor_min_rows = 1;
    });
  };
  const auto off = make(false, 0.0f);
  const auto on = make(true, 0.0f);
  const auto all_short = make(true, 60.0f);
  ASSERT_TRUE(off && on && all_short);
  for (const int32_t top_k : {1, 20, 32}) {
    const Extras want = RunExtras(*off, *batch, 0, batch->N, true, top_k);
    const Extras got = RunExtras(*on, *batch, 0, batch->N, true, top_k);
    const Extras rerun =
        RunExtras(*all_short, *batch, 0, batch->N, true, top_k);
    const Extras alone = RunExtras(*all_short, *batch, 200, 1, true, top_k);
    const std::string what = "k " + std::to_string(top_k);
    for (int64_t r = 0; r < batch->N; ++r) {
      ExpectSameExtras(want, r, got, r, "floors on, " + what);
      ExpectSameExtras(want, r, rerun, r, "every row rerun, " + what);
      if (::testing::Test::HasFailure()) return;
    }
    ExpectSameExtras(want, 200, alone, 0, "a rerun row alone, " + what);
  }
}

// Rows whose z have a light upper tail (uniform over [-1, 1]: a normal
// guess puts the floor above every value) come out short and run again,
// exactly, beside rows whose z are normal; the float64 ranking holds.
TEST(LinearLogpCudaExtras, RowsAFloorOvershootsRunAgainExactly) {
  REQUIRE_SM90();
  const int64_t H = 64, V = 20000;
  auto w = MakeWeights(H, V, V, /*bias=*/false);
  // Weight row v: (u_v, n_v, 0, ...), u uniform over [-1, 1], n normal.
  std::mt19937_64 rng(FreshSeed());
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::fill(w->host_w.begin(), w->host_w.end(), uint16_t{0});
  for (int64_t v = 0; v < V; ++v) {
    w->host_w[v * H] = FloatToBf16(uniform(rng));
    w->host_w[v * H + 1] = FloatToBf16(normal(rng));
  }
  CUDA_CHECK_THROW(cudaMemcpy(w->w.ptr, w->host_w.data(), V * H * 2,
                              cudaMemcpyHostToDevice));
  // Hidden row r: e_0 (uniform z) in blocks 0 and 2 and every 7th row of
  // block 1, e_1 (normal z) elsewhere; block 3 is short (a partial block).
  auto batch = MakeBatch(3 * 128 + 40, H, V);
  std::fill(batch->host_hidden.begin(), batch->host_hidden.end(), uint16_t{0});
  for (int64_t r = 0; r < batch->N; ++r) {
    const int64_t block = r / 128;
    const bool uniform_row =
        block == 0 || block == 2 || (block == 1 && r % 7 == 0);
    batch->host_hidden[r * H + (uniform_row ? 0 : 1)] = FloatToBf16(1.0f);
  }
  batch->Upload();
  const auto off = MakeKernelWith(
      *w, [](LinearLogpCuda::Options& o) { o.top_k_floors = false; });
  ASSERT_NE(off, nullptr);
  const auto on = MakeKernelWith(
      *w, [](LinearLogpCuda::Options& o) { o.top_k_floor_min_rows = 1; });
  ASSERT_NE(on, nullptr);
  for (const int32_t top_k : {20, 32}) {
    const Extras want = RunExtras(*off, *batch, 0, batch->N, true, top_k);
    const Extras got = RunExtras(*on, *batch, 0, batch->N, true, top_k);
    for (int64_t r = 0; r < batch->N; ++r) {
      ExpectSameExtras(want, r, got, r, "k " + std::to_string(top_k));
      if (::testing::Test::HasFailure()) return;
    }
    ExpectExtrasAccurate(*w, *batch, got, 0, {0, 7, 130, 140, 300, 400});
  }
}

// The item order (kernels/item_order.h) is a tuning knob: other row-block
// groups give every output the same bits, with and without top-k, and a
// group out of range is refused naming the field.
TEST_F(FullVocabTest, RowGroupsNeverChangeBits) {
  REQUIRE_SM90();
  auto batch = MakeBatch(4096 + 77, weights_->H, weights_->V);  // 33 row blocks
  const auto reference = MakeKernel(*weights_);
  ASSERT_NE(reference, nullptr);
  const Extras want = RunExtras(*reference, *batch, 0, batch->N, true, 20);
  for (const auto& [row_group, top_k_row_group] :
       {std::pair<int, int>{1, 0}, {16, 32}, {33, 5}, {64, 64}}) {
    LinearLogpCuda::Options o;
    o.weights = weights_->View();
    o.row_group = row_group;
    o.top_k_row_group = top_k_row_group;
    auto k = LinearLogpCuda::Create(o);
    ASSERT_TRUE(k.ok()) << k.status();
    const std::string what = "row_group " + std::to_string(row_group) +
                             ", top_k_row_group " +
                             std::to_string(top_k_row_group);
    const Extras logp_only = RunExtras(**k, *batch, 0, batch->N, false, 0);
    const Extras with_top_k = RunExtras(**k, *batch, 0, batch->N, true, 20);
    for (int64_t r = 0; r < batch->N; ++r) {
      ExpectSameExtras(want, r, logp_only, r, what);
      ExpectSameExtras(want, r, with_top_k, r, what);
      if (::testing::Test::HasFailure()) return;
    }
  }
  LinearLogpCuda::Options bad;
  bad.weights = weights_->View();
  bad.top_k_row_group = -1;
  const auto refused = LinearLogpCuda::Create(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("top_k_row_group"),
            std::string::npos)
      << refused.status();
  bad.top_k_row_group = 0;
  bad.row_group = 1 << 20;
  const auto too_large = LinearLogpCuda::Create(bad);
  EXPECT_EQ(too_large.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_large.status().message().find("row_group"), std::string::npos)
      << too_large.status();
}

}  // namespace
}  // namespace detlogp::kernels::cuda
