#include "kernels/linear_logp_cpu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "tests/linear_logp_reference.h"
#include "tests/test_data.h"

namespace detlogp::kernels {
namespace {

using detlogp::testing::MakeTestLmHead;
using detlogp::testing::RandomHidden;
using detlogp::testing::RandomTargets;
using detlogp::testing::TestLmHead;

struct Outputs {
  std::vector<float> logprobs;
  std::vector<float> lse;
};

Outputs RunKernel(const TestLmHead& head, const std::vector<uint16_t>& hidden,
                  const std::vector<int32_t>& targets,
                  const std::vector<float>& temperatures, ThreadPool* pool) {
  const int64_t rows = static_cast<int64_t>(targets.size());
  // Poisoned so that an unwritten output cannot pass.
  Outputs out{std::vector<float>(rows, NAN), std::vector<float>(rows, NAN)};
  LogpRowsView view{rows,
                    hidden.data(),
                    targets.data(),
                    temperatures.data(),
                    out.logprobs.data(),
                    out.lse.data()};
  const absl::Status status = ComputeLinearLogpCpu(head.view(), view, pool);
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

TEST(LinearLogpCpuTest, MatchesFloat64Reference) {
  for (bool with_bias : {false, true}) {
    const TestLmHead head = MakeTestLmHead(256, 3000, 3072, with_bias, 7);
    const int64_t rows = 9;
    const auto hidden = RandomHidden(rows, head.hidden_size, 11);
    const auto targets = RandomTargets(rows, head.vocab_size, 13);
    const std::vector<float> temperatures(rows, 0.7f);
    const Outputs out = RunKernel(head, hidden, targets, temperatures, nullptr);
    for (int64_t r = 0; r < rows; ++r) {
      const auto ref = detlogp::testing::ReferenceLinearLogp(
          head.view(), &hidden[r * head.hidden_size], targets[r], 0.7);
      EXPECT_NEAR(out.logprobs[r], ref.logprob, 1e-3) << "row " << r;
      EXPECT_NEAR(out.lse[r], ref.lse, 1e-3) << "row " << r;
    }
  }
}

TEST(LinearLogpCpuTest, PaddingRowsNeverCount) {
  // Padding rows carry huge weights and bias: if one leaked into the
  // softmax, lse would jump by thousands.
  const TestLmHead padded = MakeTestLmHead(128, 1000, 1088, true, 3);
  const TestLmHead unpadded = WithoutPadding(padded);
  const auto hidden = RandomHidden(5, 128, 4);
  const auto targets = RandomTargets(5, 1000, 5);
  const std::vector<float> temperatures(5, 1.0f);
  const Outputs a = RunKernel(padded, hidden, targets, temperatures, nullptr);
  const Outputs b = RunKernel(unpadded, hidden, targets, temperatures, nullptr);
  for (int r = 0; r < 5; ++r) {
    EXPECT_TRUE(SameBits(a.logprobs[r], b.logprobs[r]));
    EXPECT_TRUE(SameBits(a.lse[r], b.lse[r]));
  }
}

// A probe row alone must equal the same row at any position of any batch,
// inside any chunking, with any thread count.
TEST(LinearLogpCpuTest, RowBitsIndependentOfBatchPositionChunkingAndThreads) {
  const TestLmHead head = MakeTestLmHead(192, 4097, 4097, true, 21);
  const int64_t rows = 300;
  const auto hidden = RandomHidden(rows, head.hidden_size, 22);
  const auto targets = RandomTargets(rows, head.vocab_size, 23);
  const std::vector<float> temperatures(rows, 1.3f);
  ThreadPool pool(3);
  const Outputs full = RunKernel(head, hidden, targets, temperatures, &pool);

  // Each row alone.
  for (int64_t r : {0, 1, 3, 4, 63, 64, 127, 128, 255, 299}) {
    const std::vector<uint16_t> one(
        hidden.begin() + r * head.hidden_size,
        hidden.begin() + (r + 1) * head.hidden_size);
    const Outputs alone = RunKernel(head, one, {targets[r]}, {1.3f}, nullptr);
    EXPECT_TRUE(SameBits(alone.logprobs[0], full.logprobs[r])) << "row " << r;
    EXPECT_TRUE(SameBits(alone.lse[0], full.lse[r])) << "row " << r;
  }
  // Chunkings, single-threaded and pooled.
  for (int64_t chunk : {1, 7, 255, 256, 257}) {
    for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
      for (int64_t begin = 0; begin < rows; begin += chunk) {
        const int64_t end = std::min(rows, begin + chunk);
        const std::vector<uint16_t> part(
            hidden.begin() + begin * head.hidden_size,
            hidden.begin() + end * head.hidden_size);
        const std::vector<int32_t> part_targets(targets.begin() + begin,
                                                targets.begin() + end);
        const Outputs out = RunKernel(head, part, part_targets,
                                      std::vector<float>(end - begin, 1.3f), p);
        for (int64_t r = begin; r < end; ++r) {
          ASSERT_TRUE(SameBits(out.logprobs[r - begin], full.logprobs[r]))
              << "chunk " << chunk << " row " << r;
          ASSERT_TRUE(SameBits(out.lse[r - begin], full.lse[r]));
        }
      }
    }
  }
}

TEST(LinearLogpCpuTest, ProbeAtEveryPositionAmongDifferentNeighbours) {
  const TestLmHead head = MakeTestLmHead(64, 2049, 2049, false, 31);
  const auto probe = RandomHidden(1, 64, 32);
  const Outputs alone = RunKernel(head, probe, {77}, {1.0f}, nullptr);
  for (int64_t position : {0, 5, 63, 64, 65}) {
    auto batch = RandomHidden(66, 64, 100 + position);
    std::copy(probe.begin(), probe.end(), batch.begin() + position * 64);
    auto targets = RandomTargets(66, 2049, 200 + position);
    targets[position] = 77;
    const Outputs out =
        RunKernel(head, batch, targets, std::vector<float>(66, 1.0f), nullptr);
    EXPECT_TRUE(SameBits(out.logprobs[position], alone.logprobs[0]));
    EXPECT_TRUE(SameBits(out.lse[position], alone.lse[0]));
  }
}

TEST(LinearLogpCpuTest, RepeatedRunsGiveIdenticalBits) {
  const TestLmHead head = MakeTestLmHead(128, 5000, 5000, true, 41);
  const auto hidden = RandomHidden(17, 128, 42);
  const auto targets = RandomTargets(17, 5000, 43);
  const std::vector<float> temperatures(17, 1.0f);
  ThreadPool pool(4);
  const Outputs first = RunKernel(head, hidden, targets, temperatures, &pool);
  for (int i = 0; i < 5; ++i) {
    const Outputs again = RunKernel(head, hidden, targets, temperatures, &pool);
    EXPECT_EQ(std::memcmp(first.logprobs.data(), again.logprobs.data(),
                          17 * sizeof(float)),
              0);
    EXPECT_EQ(
        std::memcmp(first.lse.data(), again.lse.data(), 17 * sizeof(float)), 0);
  }
}

TEST(LinearLogpCpuTest, VocabularyAtGranuleAndSplitEdges) {
  for (int64_t v : {63, 64, 65, 2049, 8193}) {
    const TestLmHead head = MakeTestLmHead(64, v, v, true, v);
    const auto hidden = RandomHidden(3, 64, v + 1);
    std::vector<int32_t> targets = {0, static_cast<int32_t>(v - 1),
                                    static_cast<int32_t>(v / 2)};
    const Outputs out =
        RunKernel(head, hidden, targets, std::vector<float>(3, 1.0f), nullptr);
    for (int r = 0; r < 3; ++r) {
      const auto ref = detlogp::testing::ReferenceLinearLogp(
          head.view(), &hidden[r * 64], targets[r], 1.0);
      EXPECT_NEAR(out.logprobs[r], ref.logprob, 1e-3) << "V=" << v;
      EXPECT_NEAR(out.lse[r], ref.lse, 1e-3) << "V=" << v;
    }
  }
}

TEST(LinearLogpCpuTest, RejectsTargetsOutsideVocabularyBeforeComputing) {
  const TestLmHead head = MakeTestLmHead(64, 100, 128, false, 1);
  const auto hidden = RandomHidden(2, 64, 2);
  std::vector<float> logprobs(2, NAN), lse(2, NAN);
  const std::vector<float> temperatures(2, 1.0f);
  for (int32_t bad : {-1, 100, 127}) {  // 100..127 are padding rows
    const std::vector<int32_t> targets = {3, bad};
    LogpRowsView view{2,
                      hidden.data(),
                      targets.data(),
                      temperatures.data(),
                      logprobs.data(),
                      lse.data()};
    const absl::Status status =
        ComputeLinearLogpCpu(head.view(), view, nullptr);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(std::isnan(logprobs[0])) << "computed despite a bad target";
  }
}

}  // namespace
}  // namespace detlogp::kernels
