// The C ABI of the trainer-side ops (kernels/capi/detlogp_ops.h): its bits are
// the kernels' bits, its key is the server's, and bad arguments are rejected
// with a message naming them.
#include "kernels/capi/detlogp_ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "kernels/linear_logp_cpu.h"
#include "kernels/projection.h"
#include "kernels/projection_grad.h"
#include "kernels/random_normal.h"
#include "kernels/split_policy.h"
#include "kernels/thread_pool.h"
#include "digests/determinism_key.h"
#include "digests/lm_head_digest.h"
#include "tests/test_data.h"

namespace detlogp {
namespace {

using testing::MakeTestLmHead;
using testing::RandomHidden;
using testing::RandomTargets;
using testing::TestLmHead;

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CapiOpsTest, LinearLogpBitsEqualTheKernel) {
  for (bool with_bias : {false, true}) {
    const TestLmHead head = MakeTestLmHead(192, 1000, 1088, with_bias, 5);
    const int64_t rows = 37;
    const auto hidden = RandomHidden(rows, head.hidden_size, 9);
    const auto targets = RandomTargets(rows, head.vocab_size, 10);
    std::vector<float> temperatures(rows);
    for (int64_t r = 0; r < rows; ++r) temperatures[r] = 0.5f + 0.05f * r;

    std::vector<float> want_logp(rows, NAN), want_lse(rows, NAN);
    kernels::ThreadPool pool(3);
    kernels::LogpRowsView view{rows,
                               hidden.data(),
                               targets.data(),
                               temperatures.data(),
                               want_logp.data(),
                               want_lse.data()};
    ASSERT_TRUE(kernels::ComputeLinearLogpCpu(head.view(), view, &pool).ok());

    for (int threads : {1, 4, 0}) {
      std::vector<float> logp(rows, NAN), lse(rows, NAN);
      char error[256];
      ASSERT_EQ(
          detlogp_cpu_linear_logp(
              head.weight.data(), head.padded_vocab_size, head.hidden_size,
              with_bias ? head.bias.data() : nullptr, head.vocab_size,
              hidden.data(), rows, targets.data(), temperatures.data(), threads,
              logp.data(), lse.data(), nullptr, error, sizeof(error)),
          0)
          << error;
      EXPECT_STREQ(error, "");
      EXPECT_TRUE(SameBits(logp, want_logp)) << "threads " << threads;
      EXPECT_TRUE(SameBits(lse, want_lse)) << "threads " << threads;
    }
    // lse is optional.
    std::vector<float> logp(rows, NAN);
    ASSERT_EQ(detlogp_cpu_linear_logp(
                  head.weight.data(), head.padded_vocab_size, head.hidden_size,
                  with_bias ? head.bias.data() : nullptr, head.vocab_size,
                  hidden.data(), rows, targets.data(), temperatures.data(), 2,
                  logp.data(), nullptr, nullptr, nullptr, 0),
              0);
    EXPECT_TRUE(SameBits(logp, want_logp));

    // Entropy, asked for: the kernel's entropy bits, logprobs unchanged.
    std::vector<float> want_entropy(rows, NAN);
    view.entropy = want_entropy.data();
    ASSERT_TRUE(kernels::ComputeLinearLogpCpu(head.view(), view, &pool).ok());
    std::vector<float> entropy(rows, NAN);
    ASSERT_EQ(detlogp_cpu_linear_logp(
                  head.weight.data(), head.padded_vocab_size, head.hidden_size,
                  with_bias ? head.bias.data() : nullptr, head.vocab_size,
                  hidden.data(), rows, targets.data(), temperatures.data(), 2,
                  logp.data(), nullptr, entropy.data(), nullptr, 0),
              0);
    EXPECT_TRUE(SameBits(entropy, want_entropy));
    EXPECT_TRUE(SameBits(logp, want_logp));
  }
}

TEST(CapiOpsTest, LinearLogpRejectsBadArgumentsBeforeComputing) {
  const TestLmHead head = MakeTestLmHead(64, 100, 128, false, 1);
  const int64_t rows = 4;
  const auto hidden = RandomHidden(rows, head.hidden_size, 2);
  std::vector<int32_t> targets = {0, 1, 2, 3};
  std::vector<float> temperatures(rows, 1.0f);
  std::vector<float> logp(rows, 42.0f), lse(rows, 42.0f);
  char error[256];
  auto call = [&](int64_t vocab_size) {
    return detlogp_cpu_linear_logp(
        head.weight.data(), head.padded_vocab_size, head.hidden_size, nullptr,
        vocab_size, hidden.data(), rows, targets.data(), temperatures.data(), 1,
        logp.data(), lse.data(), nullptr, error, sizeof(error));
  };
  targets[2] = 100;  // == vocab_size: a padding row, not a token
  EXPECT_NE(call(100), 0);
  EXPECT_NE(std::string(error).find("targets[2]"), std::string::npos) << error;
  targets[2] = -1;
  EXPECT_NE(call(100), 0);
  EXPECT_NE(std::string(error).find("targets"), std::string::npos) << error;
  for (float value : logp) EXPECT_EQ(value, 42.0f);  // nothing computed
  targets[2] = 2;
  EXPECT_NE(call(129), 0);
  EXPECT_NE(std::string(error).find("vocab_size"), std::string::npos) << error;
  EXPECT_NE(call(0), 0);
  EXPECT_NE(std::string(error).find("vocab_size"), std::string::npos) << error;
  temperatures[1] = 0.0f;
  EXPECT_NE(call(100), 0);
  EXPECT_NE(std::string(error).find("temperatures[1]"), std::string::npos)
      << error;
  temperatures[1] = 1.0f;
  EXPECT_EQ(call(100), 0) << error;

  EXPECT_NE(detlogp_cpu_linear_logp(nullptr, 128, 64, nullptr, 100,
                                    hidden.data(), rows, targets.data(),
                                    temperatures.data(), 1, logp.data(),
                                    nullptr, nullptr, error, sizeof(error)),
            0);
  EXPECT_NE(std::string(error).find("weight"), std::string::npos) << error;
  EXPECT_NE(detlogp_cpu_linear_logp(head.weight.data(), 128, 0, nullptr, 100,
                                    hidden.data(), rows, targets.data(),
                                    temperatures.data(), 1, logp.data(),
                                    nullptr, nullptr, error, sizeof(error)),
            0);
  EXPECT_NE(std::string(error).find("hidden_size"), std::string::npos) << error;
  EXPECT_NE(detlogp_cpu_linear_logp(head.weight.data(), 128, 64, nullptr, 100,
                                    nullptr, rows, targets.data(),
                                    temperatures.data(), 1, logp.data(),
                                    nullptr, nullptr, error, sizeof(error)),
            0);
  EXPECT_NE(std::string(error).find("hidden"), std::string::npos) << error;
  // A short error buffer is truncated, still NUL-terminated.
  char tiny[4];
  EXPECT_NE(detlogp_cpu_linear_logp(nullptr, 128, 64, nullptr, 100,
                                    hidden.data(), rows, targets.data(),
                                    temperatures.data(), 1, logp.data(),
                                    nullptr, nullptr, tiny, sizeof(tiny)),
            0);
  EXPECT_STREQ(tiny, "wei");
}

TEST(CapiOpsTest, DeterminismKeyIsTheCpuServers) {
  const TestLmHead head = MakeTestLmHead(64, 100, 128, true, 4);
  for (bool with_bias : {false, true}) {
    digests::LmHeadShape shape;
    shape.hidden_size = head.hidden_size;
    shape.vocab_size = head.vocab_size;
    shape.padded_vocab_size = head.padded_vocab_size;
    shape.has_bias = with_bias;
    digests::DeterminismInputs inputs;
    inputs.weights_sha256 = digests::ComputeLmHeadDigest(
        shape, head.weight.data(), with_bias ? head.bias.data() : nullptr);
    inputs.backend = "cpu";
    inputs.instruction_set = "x86-64-v3/no-contract";
    inputs.kernel_version = kernels::kCpuKernelVersion;
    inputs.split_policy = kernels::kSplitPolicyName;
    const std::string want = digests::DeterminismKey(inputs);

    char key[64];
    char error[256];
    ASSERT_EQ(detlogp_cpu_determinism_key(
                  head.weight.data(), head.padded_vocab_size, head.hidden_size,
                  with_bias ? head.bias.data() : nullptr, head.vocab_size, key,
                  sizeof(key), error, sizeof(error)),
              0)
        << error;
    EXPECT_EQ(std::string(key), want);
    EXPECT_EQ(std::string(key).rfind("dk1-", 0), 0u);
  }
  char key[8];
  char error[256];
  EXPECT_NE(
      detlogp_cpu_determinism_key(head.weight.data(), 128, 64, nullptr, 100,
                                  key, sizeof(key), error, sizeof(error)),
      0);
  EXPECT_NE(std::string(error).find("key_len"), std::string::npos) << error;
}

TEST(CapiOpsTest, ProjectionBitsEqualTheKernel) {
  const int64_t in = detlogp_h3_projection_in_dim();
  const int64_t out = detlogp_h3_projection_out_dim();
  ASSERT_EQ(in, kernels::kProjectionInDim);
  ASSERT_EQ(out, kernels::kProjectionOutDim);
  kernels::RandomNormal random(17);
  std::vector<float> weight(out * in), bias(out);
  for (float& w : weight) w = random.Next(0.1f);
  for (float& b : bias) b = random.Next(0.1f);
  const int64_t rows = 5;
  std::vector<float> x(rows * in);
  for (float& v : x) v = random.Next(1.0f);
  for (bool with_bias : {false, true}) {
    kernels::ProjectionCpu::Options options;
    options.weight = weight;
    if (with_bias) options.bias = bias;
    options.num_threads = 2;
    auto cpu = kernels::ProjectionCpu::Create(options);
    ASSERT_TRUE(cpu.ok());
    std::vector<float> want(rows * out, NAN);
    ASSERT_TRUE((*cpu)->Forward(x, rows, absl::MakeSpan(want)).ok());
    std::vector<float> y(rows * out, NAN);
    char error[256];
    ASSERT_EQ(detlogp_cpu_h3_projection(x.data(), rows, weight.data(),
                                        with_bias ? bias.data() : nullptr, 0,
                                        y.data(), error, sizeof(error)),
              0)
        << error;
    EXPECT_TRUE(SameBits(y, want));
  }
  char error[256];
  EXPECT_NE(detlogp_cpu_h3_projection(x.data(), rows, nullptr, nullptr, 0,
                                      nullptr, error, sizeof(error)),
            0);
  EXPECT_NE(std::string(error).find("weight"), std::string::npos) << error;
  EXPECT_NE(detlogp_cpu_h3_projection(x.data(), -1, weight.data(), nullptr, 0,
                                      nullptr, error, sizeof(error)),
            0);
  EXPECT_NE(std::string(error).find("rows"), std::string::npos) << error;
}

TEST(CapiOpsTest, ProjectionGradsEqualTheKernels) {
  const int64_t in = kernels::kProjectionInDim;
  const int64_t out = kernels::kProjectionOutDim;
  kernels::RandomNormal random(23);
  std::vector<float> weight(out * in);
  for (float& w : weight) w = random.Next(0.1f);
  const int64_t rows = 7;
  std::vector<float> x(rows * in), dy(rows * out);
  for (float& v : x) v = random.Next(1.0f);
  for (float& v : dy) v = random.Next(1.0f);
  char error[256];

  std::vector<float> want_dx(rows * in, NAN), dx(rows * in, NAN);
  ASSERT_TRUE(
      kernels::ProjectionInputGrad(weight, dy, rows, absl::MakeSpan(want_dx), 1)
          .ok());
  ASSERT_EQ(
      detlogp_cpu_h3_projection_input_grad(weight.data(), dy.data(), rows, 0,
                                           dx.data(), error, sizeof(error)),
      0)
      << error;
  EXPECT_TRUE(SameBits(dx, want_dx));

  const int64_t first_key = 4090;  // crosses a 4096-key superchunk
  std::vector<int64_t> keys(rows);
  for (int64_t i = 0; i < rows; ++i) keys[i] = first_key + i;
  auto want = kernels::ComputeProjectionWeightGrads(dy, x, keys, 1);
  ASSERT_TRUE(want.ok());
  std::vector<float> dweight(out * in, NAN), dbias(out, NAN);
  ASSERT_EQ(detlogp_cpu_h3_projection_weight_grad(
                dy.data(), x.data(), rows, first_key, 0, dweight.data(),
                dbias.data(), error, sizeof(error)),
            0)
      << error;
  EXPECT_TRUE(SameBits(dweight, want->dweight));
  EXPECT_TRUE(SameBits(dbias, want->dbias));

  EXPECT_NE(detlogp_cpu_h3_projection_weight_grad(dy.data(), x.data(), rows, -1,
                                                  0, dweight.data(), nullptr,
                                                  error, sizeof(error)),
            0);
  EXPECT_NE(std::string(error).find("first_key"), std::string::npos) << error;
  EXPECT_NE(detlogp_cpu_h3_projection_input_grad(
                nullptr, dy.data(), rows, 0, dx.data(), error, sizeof(error)),
            0);
  EXPECT_NE(std::string(error).find("weight"), std::string::npos) << error;
}

}  // namespace
}  // namespace detlogp
