// Entropy and top-k of the CPU fused linear-logp: float64 references, edge
// rows (peaked, flat, padding), and the batch-invariance contract for the
// new outputs, including that asking for them leaves logprob/lse bits alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/linear_logp_cpu.h"
#include "tests/linear_logp_reference.h"
#include "tests/test_data.h"

namespace detlogp::kernels {
namespace {

using detlogp::testing::MakeTestLmHead;
using detlogp::testing::RandomHidden;
using detlogp::testing::RandomTargets;
using detlogp::testing::ReferenceEntropyAndRanking;
using detlogp::testing::TestLmHead;

struct Extras {
  bool entropy = false;
  int32_t top_k = 0;
};

struct Outputs {
  std::vector<float> logprobs;
  std::vector<float> lse;
  std::vector<float> entropy;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

Outputs RunKernel(const TestLmHead& head, const std::vector<uint16_t>& hidden,
                  const std::vector<int32_t>& targets,
                  const std::vector<float>& temperatures, Extras extras,
                  ThreadPool* pool) {
  const int64_t rows = static_cast<int64_t>(targets.size());
  // Poisoned so that an unwritten output cannot pass.
  Outputs out;
  out.logprobs.assign(rows, NAN);
  out.lse.assign(rows, NAN);
  out.entropy.assign(rows, NAN);
  out.top_ids.assign(rows * extras.top_k, -1);
  out.top_logprobs.assign(rows * extras.top_k, NAN);
  LogpRowsView view{rows,
                    hidden.data(),
                    targets.data(),
                    temperatures.data(),
                    out.logprobs.data(),
                    out.lse.data()};
  if (extras.entropy) view.entropy = out.entropy.data();
  view.top_k = extras.top_k;
  view.top_ids = out.top_ids.data();
  view.top_logprobs = out.top_logprobs.data();
  const absl::Status status = ComputeLinearLogpCpu(head.view(), view, pool);
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

bool SameBits(const void* a, const void* b, size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}
bool SameBits(float a, float b) { return SameBits(&a, &b, sizeof(a)); }

// Checks row `r` of `out` against the float64 reference: entropy within
// 2e-3; top-k ids equal the reference ranking wherever the reference gaps
// on both sides exceed 1e-4 (near-ties may swap), log-probs within 1e-3.
void ExpectRowMatchesReference(const TestLmHead& head,
                               const std::vector<uint16_t>& hidden,
                               double temperature, const Outputs& out,
                               int64_t r, Extras extras) {
  const auto ref = ReferenceEntropyAndRanking(
      head.view(), &hidden[r * head.hidden_size], temperature);
  if (extras.entropy) {
    EXPECT_NEAR(out.entropy[r], ref.entropy, 2e-3) << "row " << r;
  }
  const int32_t k = extras.top_k;
  for (int32_t i = 0; i < k; ++i) {
    const int32_t id = out.top_ids[r * k + i];
    ASSERT_GE(id, 0) << "row " << r << " rank " << i;
    ASSERT_LT(id, head.vocab_size) << "padding chosen, row " << r;
    const double z_i = ref.z[ref.ranked[i]];
    const bool gap_before = i == 0 || ref.z[ref.ranked[i - 1]] - z_i > 1e-4;
    const bool gap_after = i + 1 >= static_cast<int32_t>(ref.ranked.size()) ||
                           z_i - ref.z[ref.ranked[i + 1]] > 1e-4;
    if (gap_before && gap_after) {
      EXPECT_EQ(id, ref.ranked[i]) << "row " << r << " rank " << i;
    }
    EXPECT_NEAR(out.top_logprobs[r * k + i], z_i - ref.lse, 1e-3)
        << "row " << r << " rank " << i;
    // The value reported is the chosen id's own log-prob.
    EXPECT_NEAR(out.top_logprobs[r * k + i], ref.z[id] - ref.lse, 1e-3);
    if (i > 0) {
      EXPECT_GE(out.top_logprobs[r * k + i - 1], out.top_logprobs[r * k + i])
          << "row " << r << " not descending at rank " << i;
    }
  }
}

TEST(EntropyTopKCpuTest, MatchesFloat64ReferenceWithBiasAndTemperature) {
  for (bool with_bias : {false, true}) {
    for (float temperature : {0.7f, 1.0f, 1.9f}) {
      const TestLmHead head = MakeTestLmHead(256, 3000, 3072, with_bias, 7);
      const int64_t rows = 9;
      const auto hidden = RandomHidden(rows, head.hidden_size, 11);
      const auto targets = RandomTargets(rows, head.vocab_size, 13);
      const std::vector<float> temperatures(rows, temperature);
      const Extras extras{true, 20};
      ThreadPool pool(2);
      const Outputs out =
          RunKernel(head, hidden, targets, temperatures, extras, &pool);
      for (int64_t r = 0; r < rows; ++r) {
        SCOPED_TRACE(::testing::Message()
                     << "bias " << with_bias << " T " << temperature);
        ExpectRowMatchesReference(head, hidden, temperature, out, r, extras);
      }
    }
  }
}

TEST(EntropyTopKCpuTest, MatchesReferenceAtVocabularyEdgesAndLargestK) {
  // V at granule and split edges; k up to kMaxTopK and up to V itself.
  for (int64_t v : {32, 63, 64, 65, 2049, 8513}) {
    const TestLmHead head = MakeTestLmHead(64, v, v, true, v);
    const auto hidden = RandomHidden(3, 64, v + 1);
    const auto targets = RandomTargets(3, v, v + 2);
    const Extras extras{true,
                        static_cast<int32_t>(std::min<int64_t>(kMaxTopK, v))};
    const Outputs out = RunKernel(head, hidden, targets,
                                  std::vector<float>(3, 1.0f), extras, nullptr);
    for (int64_t r = 0; r < 3; ++r) {
      SCOPED_TRACE(::testing::Message() << "V=" << v);
      ExpectRowMatchesReference(head, hidden, 1.0, out, r, extras);
    }
  }
}

TEST(EntropyTopKCpuTest, PeakedRowHasNearZeroEntropyAndThePeakFirst) {
  // One logit 60 above the rest (bias), placed in the last split so the
  // peak arrives late in the fold.
  TestLmHead head = MakeTestLmHead(128, 5000, 5000, true, 51);
  const int32_t peak = 4990;
  head.bias[peak] = 60.0f;
  const auto hidden = RandomHidden(2, 128, 52);
  const Extras extras{true, 5};
  const Outputs out = RunKernel(head, hidden, {1, peak},
                                std::vector<float>(2, 1.0f), extras, nullptr);
  for (int64_t r = 0; r < 2; ++r) {
    ExpectRowMatchesReference(head, hidden, 1.0, out, r, extras);
    EXPECT_NEAR(out.entropy[r], 0.0, 2e-3);
    EXPECT_EQ(out.top_ids[r * 5], peak);
    EXPECT_NEAR(out.top_logprobs[r * 5], 0.0, 1e-3);
    EXPECT_LT(out.top_logprobs[r * 5 + 1], -50.0f);
  }
  // The target's log-prob and the top-1's are the same float operations.
  EXPECT_TRUE(SameBits(out.logprobs[1], out.top_logprobs[5]));
}

TEST(EntropyTopKCpuTest, FlatRowHasEntropyLogVAndTheLowestIds) {
  // All-zero hidden rows and a constant bias: every z is equal, in every
  // split. Entropy = log V; ties go to the lower ids.
  for (int64_t v : {100, 4097, 20000}) {
    TestLmHead head = MakeTestLmHead(64, v, v + 64, true, 61);
    for (int64_t i = 0; i < v; ++i) head.bias[i] = 0.375f;
    const std::vector<uint16_t> hidden(2 * 64, FloatToBf16(0.0f));
    const Extras extras{true, 20};
    const Outputs out =
        RunKernel(head, hidden, {0, static_cast<int32_t>(v - 1)}, {1.0f, 0.6f},
                  extras, nullptr);
    for (int64_t r = 0; r < 2; ++r) {
      SCOPED_TRACE(::testing::Message() << "V=" << v << " row " << r);
      EXPECT_NEAR(out.entropy[r], std::log(static_cast<double>(v)), 2e-3);
      for (int32_t i = 0; i < 20; ++i) {
        EXPECT_EQ(out.top_ids[r * 20 + i], i);
        EXPECT_NEAR(out.top_logprobs[r * 20 + i],
                    -std::log(static_cast<double>(v)), 1e-3);
        EXPECT_TRUE(SameBits(out.top_logprobs[r * 20 + i], out.logprobs[r]));
      }
    }
  }
}

TEST(EntropyTopKCpuTest, PaddingRowsAreNeverChosenAndNeverCount) {
  // Padding rows carry huge weights and bias: chosen or summed, they would
  // dominate every output.
  const TestLmHead padded = MakeTestLmHead(128, 1000, 1088, true, 3);
  const TestLmHead unpadded = WithoutPadding(padded);
  const auto hidden = RandomHidden(5, 128, 4);
  const auto targets = RandomTargets(5, 1000, 5);
  const std::vector<float> temperatures(5, 1.0f);
  const Extras extras{true, kMaxTopK};
  const Outputs a =
      RunKernel(padded, hidden, targets, temperatures, extras, nullptr);
  const Outputs b =
      RunKernel(unpadded, hidden, targets, temperatures, extras, nullptr);
  for (int32_t id : a.top_ids) EXPECT_LT(id, 1000);
  EXPECT_TRUE(SameBits(a.entropy.data(), b.entropy.data(), 5 * sizeof(float)));
  EXPECT_EQ(a.top_ids, b.top_ids);
  EXPECT_TRUE(SameBits(a.top_logprobs.data(), b.top_logprobs.data(),
                       a.top_logprobs.size() * sizeof(float)));
}

// Whatever else a call computes, logprob and lse keep the logp-only bits,
// and entropy and the top lists keep theirs (top-k for smaller k a prefix).
TEST(EntropyTopKCpuTest, ExtrasNeverChangeEachOtherOrLogprobBits) {
  const TestLmHead head = MakeTestLmHead(192, 4097, 4160, true, 71);
  const int64_t rows = 37;
  const auto hidden = RandomHidden(rows, head.hidden_size, 72);
  const auto targets = RandomTargets(rows, head.vocab_size, 73);
  const std::vector<float> temperatures(rows, 0.9f);
  ThreadPool pool(3);
  const Outputs plain =
      RunKernel(head, hidden, targets, temperatures, {}, &pool);
  const Outputs full =
      RunKernel(head, hidden, targets, temperatures, {true, kMaxTopK}, &pool);
  const size_t bytes = rows * sizeof(float);
  for (Extras extras : {Extras{true, 0}, Extras{false, 1}, Extras{false, 3},
                        Extras{true, 20}, Extras{true, kMaxTopK}}) {
    SCOPED_TRACE(::testing::Message()
                 << "entropy " << extras.entropy << " k " << extras.top_k);
    const Outputs out =
        RunKernel(head, hidden, targets, temperatures, extras, &pool);
    EXPECT_TRUE(SameBits(out.logprobs.data(), plain.logprobs.data(), bytes));
    EXPECT_TRUE(SameBits(out.lse.data(), plain.lse.data(), bytes));
    if (extras.entropy) {
      EXPECT_TRUE(SameBits(out.entropy.data(), full.entropy.data(), bytes));
    }
    const int32_t k = extras.top_k;
    for (int64_t r = 0; r < rows; ++r) {
      for (int32_t i = 0; i < k; ++i) {
        ASSERT_EQ(out.top_ids[r * k + i], full.top_ids[r * kMaxTopK + i]);
        ASSERT_TRUE(SameBits(out.top_logprobs[r * k + i],
                             full.top_logprobs[r * kMaxTopK + i]));
      }
    }
  }
}

// A probe row alone must equal the same row at any position of any batch,
// inside any chunking, with any thread count; across the 512-row passes
// that top-k lists take too.
TEST(EntropyTopKCpuTest, RowBitsIndependentOfBatchPositionChunkingAndThreads) {
  const TestLmHead head = MakeTestLmHead(64, 2049, 2049, true, 81);
  const int64_t rows = 700;
  const auto hidden = RandomHidden(rows, head.hidden_size, 82);
  const auto targets = RandomTargets(rows, head.vocab_size, 83);
  const std::vector<float> temperatures(rows, 1.3f);
  const Extras extras{true, 20};
  ThreadPool pool(3);
  const Outputs full =
      RunKernel(head, hidden, targets, temperatures, extras, &pool);

  auto expect_rows_equal = [&](const Outputs& out, int64_t out_row, int64_t r) {
    ASSERT_TRUE(SameBits(out.entropy[out_row], full.entropy[r])) << "row " << r;
    ASSERT_TRUE(SameBits(&out.top_ids[out_row * 20], &full.top_ids[r * 20],
                         20 * sizeof(int32_t)))
        << "row " << r;
    ASSERT_TRUE(SameBits(&out.top_logprobs[out_row * 20],
                         &full.top_logprobs[r * 20], 20 * sizeof(float)))
        << "row " << r;
    ASSERT_TRUE(SameBits(out.lse[out_row], full.lse[r])) << "row " << r;
  };
  for (int64_t r : {0, 1, 3, 4, 255, 511, 512, 513, 699}) {
    const std::vector<uint16_t> one(
        hidden.begin() + r * head.hidden_size,
        hidden.begin() + (r + 1) * head.hidden_size);
    const Outputs alone =
        RunKernel(head, one, {targets[r]}, {1.3f}, extras, nullptr);
    expect_rows_equal(alone, 0, r);
  }
  for (int64_t chunk : {1, 7, 256, 513}) {
    for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
      for (int64_t begin = 0; begin < rows; begin += chunk) {
        const int64_t end = std::min(rows, begin + chunk);
        const std::vector<uint16_t> part(
            hidden.begin() + begin * head.hidden_size,
            hidden.begin() + end * head.hidden_size);
        const std::vector<int32_t> part_targets(targets.begin() + begin,
                                                targets.begin() + end);
        const Outputs out =
            RunKernel(head, part, part_targets,
                      std::vector<float>(end - begin, 1.3f), extras, p);
        for (int64_t r = begin; r < end; ++r) {
          SCOPED_TRACE(::testing::Message() << "chunk " << chunk);
          expect_rows_equal(out, r - begin, r);
        }
      }
    }
  }
}

TEST(EntropyTopKCpuTest, ProbeAtEveryPositionAmongDifferentNeighbours) {
  const TestLmHead head = MakeTestLmHead(64, 2049, 2049, false, 91);
  const auto probe = RandomHidden(1, 64, 92);
  const Extras extras{true, 8};
  const Outputs alone = RunKernel(head, probe, {77}, {0.8f}, extras, nullptr);
  for (int64_t position : {0, 5, 63, 64, 65}) {
    auto batch = RandomHidden(66, 64, 100 + position);
    std::copy(probe.begin(), probe.end(), batch.begin() + position * 64);
    auto targets = RandomTargets(66, 2049, 200 + position);
    targets[position] = 77;
    // Neighbours at other temperatures: only the probe's own must matter.
    std::vector<float> temperatures(66, 1.7f);
    temperatures[position] = 0.8f;
    const Outputs out =
        RunKernel(head, batch, targets, temperatures, extras, nullptr);
    EXPECT_TRUE(SameBits(out.entropy[position], alone.entropy[0]));
    EXPECT_TRUE(SameBits(&out.top_ids[position * 8], alone.top_ids.data(),
                         8 * sizeof(int32_t)));
    EXPECT_TRUE(SameBits(&out.top_logprobs[position * 8],
                         alone.top_logprobs.data(), 8 * sizeof(float)));
  }
}

TEST(EntropyTopKCpuTest, RejectsBadTopKAndMissingBuffers) {
  const TestLmHead head = MakeTestLmHead(64, 20, 64, false, 1);
  const auto hidden = RandomHidden(2, 64, 2);
  const std::vector<int32_t> targets = {3, 4};
  const std::vector<float> temperatures(2, 1.0f);
  std::vector<float> logprobs(2, NAN), lse(2, NAN), top_logprobs(2 * 64);
  std::vector<int32_t> top_ids(2 * 64);
  for (int32_t bad : {-1, 21, kMaxTopK + 1}) {  // V = 20
    LogpRowsView view{2,
                      hidden.data(),
                      targets.data(),
                      temperatures.data(),
                      logprobs.data(),
                      lse.data()};
    view.top_k = bad;
    view.top_ids = top_ids.data();
    view.top_logprobs = top_logprobs.data();
    const absl::Status status =
        ComputeLinearLogpCpu(head.view(), view, nullptr);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(status.message().find("top_k"), absl::string_view::npos)
        << status;
    EXPECT_TRUE(std::isnan(logprobs[0])) << "computed despite top_k " << bad;
  }
  LogpRowsView view{2,
                    hidden.data(),
                    targets.data(),
                    temperatures.data(),
                    logprobs.data(),
                    lse.data()};
  view.top_k = 3;
  view.top_logprobs = top_logprobs.data();
  EXPECT_EQ(ComputeLinearLogpCpu(head.view(), view, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  // k = V is allowed: the whole vocabulary, ranked.
  view.top_k = 20;
  view.top_ids = top_ids.data();
  ASSERT_TRUE(ComputeLinearLogpCpu(head.view(), view, nullptr).ok());
  std::vector<int32_t> seen(top_ids.begin(), top_ids.begin() + 20);
  std::sort(seen.begin(), seen.end());
  for (int32_t i = 0; i < 20; ++i) EXPECT_EQ(seen[i], i);
}

}  // namespace
}  // namespace detlogp::kernels
