// GPU tests of the linear-logp backward
// (kernels/cuda/linear_logp_backward_cuda.h): accuracy against float64,
// batch invariance of dhidden (memcmp), run-to-run identical dweight/dbias,
// bf16 outputs as the rounded fp32 ones, zero gradient for padding rows,
// passes of kMaxRowsPerPass rows, and input checks. Skipped without an sm_90
// GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/cuda/linear_logp_backward_cuda.h"
#include "tests/cuda/linear_logp_test_support.cuh"

namespace detlogp::kernels::cuda {
namespace {

// Two vocabulary chunks (4096 + 1024 columns), 120 of them padding.
constexpr int64_t kH = 256;
constexpr int64_t kV = 5000;
constexpr int64_t kVpad = 5120;

// Per-row forward state and upstream gradients of a batch, float64 on the
// host (the forward's lse/entropy are the exact ones rounded to float).
struct RowGrads {
  std::vector<float> lse, entropy, g_logp, g_lse, g_ent;
};

struct Outputs {
  std::vector<float> d_hidden, d_weight, d_bias;
};

// The parameter: whether grad_entropy is given (the trainer's twin gives
// none, so G has no entropy term).
class LinearLogpBackwardTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    REQUIRE_SM90();
    weights_ = MakeWeights(kH, kV, kVpad, /*bias=*/true);
    LinearLogpBackwardCuda::Options o;
    o.weights = weights_->View();
    auto made = LinearLogpBackwardCuda::Create(o);
    ASSERT_TRUE(made.ok()) << made.status();
    backward_ = std::move(*made);
  }

  // z of every real column of row r, float64.
  std::vector<double> Logits(const Batch& b, int64_t r) const {
    std::vector<double> z(kV);
    for (int64_t v = 0; v < kV; ++v) {
      double acc = 0.0;
      for (int64_t k = 0; k < kH; ++k) {
        acc += static_cast<double>(Bf16ToFloat(b.host_hidden[r * kH + k])) *
               Bf16ToFloat(weights_->host_w[v * kH + k]);
      }
      z[v] = (acc + weights_->host_b[v]) / b.host_temps[r];
    }
    return z;
  }

  RowGrads MakeRowGrads(const Batch& b) const {
    RowGrads g;
    std::mt19937_64 rng(FreshSeed());
    std::normal_distribution<float> n01(0.0f, 1.0f);
    for (int64_t r = 0; r < b.N; ++r) {
      const std::vector<double> z = Logits(b, r);
      double m = -INFINITY;
      for (double x : z) m = std::max(m, x);
      double s = 0.0, sz = 0.0;
      for (double x : z) s += std::exp(x - m);
      const double lse = m + std::log(s);
      for (double x : z) sz += std::exp(x - lse) * x;
      g.lse.push_back(static_cast<float>(lse));
      g.entropy.push_back(static_cast<float>(lse - sz));
      g.g_logp.push_back(n01(rng));
      g.g_lse.push_back(n01(rng));
      g.g_ent.push_back(GetParam() ? n01(rng) : 0.0f);
    }
    return g;
  }

  // Runs the backward on rows [start, start + count) of `b` (fp32 outputs
  // unless told), poisoning the outputs first.
  Outputs Run(const Batch& b, const RowGrads& g, int64_t start, int64_t count,
              GradDtype hidden_dtype = GradDtype::kFloat32,
              GradDtype weight_dtype = GradDtype::kFloat32) const {
    const auto rows_of = [&](const std::vector<float>& all) {
      DevBuf<float> d(count);
      d.FromHost(
          std::vector<float>(all.begin() + start, all.begin() + start + count));
      return d;
    };
    DevBuf<float> lse = rows_of(g.lse), ent = rows_of(g.entropy),
                  gl = rows_of(g.g_logp), gs = rows_of(g.g_lse),
                  ge = rows_of(g.g_ent);
    DevBuf<float> dh(count * kH), dw(kVpad * kH), db(kVpad);
    CUDA_CHECK_THROW(cudaMemset(dh.ptr, 0xFF, dh.n * 4));
    CUDA_CHECK_THROW(cudaMemset(dw.ptr, 0xFF, dw.n * 4));
    CUDA_CHECK_THROW(cudaMemset(db.ptr, 0xFF, db.n * 4));
    LinearLogpGradView view;
    view.hidden = b.hidden.ptr + start * kH;
    view.rows = count;
    view.targets = b.targets.ptr + start;
    view.temperatures = b.temps.ptr + start;
    view.lse = lse.ptr;
    view.entropy = ent.ptr;
    view.grad_logprobs = gl.ptr;
    view.grad_lse = gs.ptr;
    view.grad_entropy = GetParam() ? ge.ptr : nullptr;
    view.grad_hidden = dh.ptr;
    view.grad_hidden_dtype = hidden_dtype;
    view.grad_weight = dw.ptr;
    view.grad_weight_dtype = weight_dtype;
    view.grad_bias = db.ptr;
    DevBuf<uint8_t> ws(backward_->WorkspaceBytes(view));
    const absl::Status s = backward_->Launch(view, ws.ptr, ws.n, nullptr);
    EXPECT_TRUE(s.ok()) << s;
    CUDA_CHECK_THROW(cudaDeviceSynchronize());
    Outputs out{dh.ToHost(), dw.ToHost(), db.ToHost()};
    // bf16 outputs occupy the first half of each buffer's bytes.
    if (hidden_dtype == GradDtype::kBfloat16)
      out.d_hidden.resize(count * kH / 2);
    if (weight_dtype == GradDtype::kBfloat16)
      out.d_weight.resize(kVpad * kH / 2);
    return out;
  }

  std::unique_ptr<Weights> weights_;
  std::unique_ptr<LinearLogpBackwardCuda> backward_;
};

double RelativeFrobenius(const std::vector<float>& got,
                         const std::vector<double>& want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

TEST_P(LinearLogpBackwardTest, MatchesFloat64Reference) {
  const int64_t n = 300;
  auto b = MakeBatch(n, kH, kV);
  const RowGrads g = MakeRowGrads(*b);
  const Outputs out = Run(*b, g, 0, n);
  std::vector<double> dh(n * kH, 0.0), dw(kVpad * kH, 0.0), db(kVpad, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    const std::vector<double> z = Logits(*b, r);
    const double t = b->host_temps[r];
    for (int64_t v = 0; v < kV; ++v) {
      const double d = z[v] - g.lse[r];
      const double p = std::exp(d);
      double dz =
          p * (g.g_lse[r] - g.g_logp[r] - g.g_ent[r] * (d + g.entropy[r]));
      if (v == b->host_targets[r]) dz += g.g_logp[r];
      const double gv = dz / t;
      db[v] += gv;
      for (int64_t k = 0; k < kH; ++k) {
        const double x = Bf16ToFloat(b->host_hidden[r * kH + k]);
        dh[r * kH + k] += gv * Bf16ToFloat(weights_->host_w[v * kH + k]);
        dw[v * kH + k] += gv * x;
      }
    }
  }
  const double e_h = RelativeFrobenius(out.d_hidden, dh);
  const double e_w = RelativeFrobenius(out.d_weight, dw);
  const double e_b = RelativeFrobenius(out.d_bias, db);
  std::printf(
      "relative Frobenius error: dhidden %.3g dweight %.3g dbias %.3g\n", e_h,
      e_w, e_b);
  // G is rounded to bf16 (relative 2^-9 per element), as PyTorch's bf16
  // logits gradient is.
  EXPECT_LT(e_h, 5e-3);
  EXPECT_LT(e_w, 5e-3);
  EXPECT_LT(e_b, 5e-3);
}

TEST_P(LinearLogpBackwardTest, PaddingRowsGetZeroGradient) {
  auto b = MakeBatch(64, kH, kV);
  const Outputs out = Run(*b, MakeRowGrads(*b), 0, 64);
  for (int64_t v = kV; v < kVpad; ++v) {
    EXPECT_EQ(out.d_bias[v], 0.0f) << "dbias of padding row " << v;
    for (int64_t k = 0; k < kH; ++k) {
      ASSERT_EQ(out.d_weight[v * kH + k], 0.0f)
          << "dweight of padding row " << v;
    }
  }
}

TEST_P(LinearLogpBackwardTest, HiddenGradOfARowIsBatchInvariant) {
  const int64_t n = 300;
  auto b = MakeBatch(n, kH, kV);
  const RowGrads g = MakeRowGrads(*b);
  const Outputs all = Run(*b, g, 0, n);
  for (int64_t r : {int64_t{0}, int64_t{1}, int64_t{127}, int64_t{128},
                    int64_t{200}, n - 1}) {
    const Outputs alone = Run(*b, g, r, 1);
    EXPECT_EQ(0, std::memcmp(alone.d_hidden.data(),
                             all.d_hidden.data() + r * kH, kH * 4))
        << "row " << r << " alone vs in a batch of " << n;
  }
  const Outputs tail = Run(*b, g, 37, n - 37);  // every row at a new position
  EXPECT_EQ(0, std::memcmp(tail.d_hidden.data(), all.d_hidden.data() + 37 * kH,
                           (n - 37) * kH * 4));
}

TEST_P(LinearLogpBackwardTest, TwoCallsGiveIdenticalBits) {
  auto b = MakeBatch(200, kH, kV);
  const RowGrads g = MakeRowGrads(*b);
  const Outputs first = Run(*b, g, 0, 200);
  const Outputs second = Run(*b, g, 0, 200);
  EXPECT_EQ(0, std::memcmp(first.d_hidden.data(), second.d_hidden.data(),
                           first.d_hidden.size() * 4));
  EXPECT_EQ(0, std::memcmp(first.d_weight.data(), second.d_weight.data(),
                           first.d_weight.size() * 4));
  EXPECT_EQ(0, std::memcmp(first.d_bias.data(), second.d_bias.data(),
                           first.d_bias.size() * 4));
}

TEST_P(LinearLogpBackwardTest, Bf16OutputsAreTheRoundedFp32Ones) {
  const int64_t n = 150;
  auto b = MakeBatch(n, kH, kV);
  const RowGrads g = MakeRowGrads(*b);
  const Outputs f32 = Run(*b, g, 0, n);
  const Outputs bf16 =
      Run(*b, g, 0, n, GradDtype::kBfloat16, GradDtype::kBfloat16);
  const auto* h16 = reinterpret_cast<const uint16_t*>(bf16.d_hidden.data());
  for (int64_t i = 0; i < n * kH; ++i) {
    ASSERT_EQ(h16[i], FloatToBf16(f32.d_hidden[i])) << "dhidden element " << i;
  }
  const auto* w16 = reinterpret_cast<const uint16_t*>(bf16.d_weight.data());
  for (int64_t i = 0; i < kVpad * kH; ++i) {
    ASSERT_EQ(w16[i], FloatToBf16(f32.d_weight[i])) << "dweight element " << i;
  }
}

TEST_P(LinearLogpBackwardTest, RowsPastOnePassKeepTheirBits) {
  const int64_t n = LinearLogpBackwardCuda::kMaxRowsPerPass + 37;
  auto b = MakeBatch(n, kH, kV);
  RowGrads g;  // random state: exactness is not the point here
  std::mt19937_64 rng(FreshSeed());
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int64_t r = 0; r < n; ++r) {
    g.lse.push_back(3.0f + n01(rng));
    g.entropy.push_back(8.0f);
    g.g_logp.push_back(n01(rng));
    g.g_lse.push_back(n01(rng));
    g.g_ent.push_back(n01(rng));
  }
  const Outputs all = Run(*b, g, 0, n);
  for (int64_t r : {int64_t{0}, LinearLogpBackwardCuda::kMaxRowsPerPass - 1,
                    LinearLogpBackwardCuda::kMaxRowsPerPass, n - 1}) {
    const Outputs alone = Run(*b, g, r, 1);
    EXPECT_EQ(0, std::memcmp(alone.d_hidden.data(),
                             all.d_hidden.data() + r * kH, kH * 4))
        << "row " << r;
  }
  // A bf16 dweight cannot accumulate across passes.
  LinearLogpGradView view;
  view.hidden = b->hidden.ptr;
  view.rows = n;
  view.lse = b->temps.ptr;
  view.grad_weight = b->temps.ptr;
  view.grad_weight_dtype = GradDtype::kBfloat16;
  const absl::Status s = backward_->Launch(view, nullptr, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("grad_weight_dtype"), std::string::npos) << s;
}

TEST_P(LinearLogpBackwardTest, BadInputsNameTheirField) {
  auto b = MakeBatch(8, kH, kV);
  DevBuf<float> f(8 * kH);
  const auto expect_field = [&](LinearLogpGradView view, const char* field) {
    DevBuf<uint8_t> ws(1 << 20);
    const absl::Status s = backward_->Launch(view, ws.ptr, ws.n, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
  };
  LinearLogpGradView ok;
  ok.hidden = b->hidden.ptr;
  ok.rows = 8;
  ok.lse = f.ptr;
  ok.grad_hidden = f.ptr;
  LinearLogpGradView v = ok;
  v.lse = nullptr;
  expect_field(v, "lse");
  v = ok;
  v.grad_entropy = f.ptr;
  expect_field(v, "entropy");
  v = ok;
  v.grad_logprobs = f.ptr;
  expect_field(v, "targets");
  v = ok;
  v.grad_hidden = nullptr;
  expect_field(v, "grad_hidden/grad_weight/grad_bias");
  v = ok;
  v.rows = 0;
  expect_field(v, "rows");
  v = ok;
  v.temperature = 0.0f;
  expect_field(v, "temperature");

  LinearLogpBackwardCuda::Options o;
  o.weights = weights_->View();
  o.weights.hidden_size = 96;
  EXPECT_EQ(LinearLogpBackwardCuda::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(EntropyGrad, LinearLogpBackwardTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "WithGradEntropy"
                                             : "WithoutGradEntropy";
                         });

}  // namespace
}  // namespace detlogp::kernels::cuda
