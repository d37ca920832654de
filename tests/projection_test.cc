// CPU tests of the H3 video input projection: accuracy against float64, the
// fixed order (bit-exact against a scalar transcription of the contract),
// batch invariance, keyed gradient invariance and error handling.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/projection.h"
#include "kernels/projection_grad.h"

namespace detlogp::kernels {
namespace {

constexpr int64_t kK = kProjectionInDim;
constexpr int64_t kN = kProjectionOutDim;

std::vector<float> RandomVector(int64_t n, float scale, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// |got - ref| <= 1e-4 + 1e-4 |ref| everywhere, NaN fails.
void ExpectClose(const std::vector<float>& got,
                 const std::vector<double>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(err <= 1e-4 + 1e-4 * std::fabs(ref[i]))) {
      if (bad++ < 5)
        ADD_FAILURE() << "i=" << i << " got=" << got[i] << " ref=" << ref[i];
    }
  }
  EXPECT_EQ(bad, 0);
}

struct Problem {
  std::vector<float> weight, bias;
  explicit Problem(std::mt19937_64& rng)
      : weight(RandomVector(kN * kK, 1.f / std::sqrt(96.f), rng)),
        bias(RandomVector(kN, 0.5f, rng)) {}
};

std::unique_ptr<ProjectionCpu> MakeCpu(const Problem& p, bool with_bias,
                                       int threads = 0) {
  ProjectionCpu::Options o;
  o.weight = p.weight;
  if (with_bias) o.bias = p.bias;
  o.num_threads = threads;
  auto cpu = ProjectionCpu::Create(o);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  return std::move(*cpu);
}

std::vector<float> Forward(const ProjectionCpu& cpu,
                           const std::vector<float>& x) {
  const int64_t rows = static_cast<int64_t>(x.size()) / kK;
  std::vector<float> y(rows * kN, std::nanf(""));
  EXPECT_TRUE(cpu.Forward(x, rows, absl::MakeSpan(y)).ok());
  return y;
}

TEST(ProjectionCpuTest, ForwardMatchesFloat64AndTheWrittenOrder) {
  std::mt19937_64 rng(1);
  Problem p(rng);
  for (bool with_bias : {true, false}) {
    const int64_t rows = 33;
    std::vector<float> x = RandomVector(rows * kK, 1.f, rng);
    std::vector<float> y = Forward(*MakeCpu(p, with_bias), x);
    std::vector<double> ref(rows * kN);
    std::vector<float> exact(rows * kN);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < kN; ++o) {
        double d = with_bias ? p.bias[o] : 0.0;
        float acc = 0.f;  // the contract, transcribed literally
        for (int64_t k = 0; k < kK; ++k) {
          d += static_cast<double>(x[r * kK + k]) * p.weight[o * kK + k];
          acc = std::fma(x[r * kK + k], p.weight[o * kK + k], acc);
        }
        ref[r * kN + o] = d;
        exact[r * kN + o] = with_bias ? acc + p.bias[o] : acc;
      }
    }
    ExpectClose(y, ref);
    EXPECT_TRUE(SameBits(y, exact)) << "with_bias=" << with_bias;
  }
}

TEST(ProjectionCpuTest, RowBitsIgnorePermutationMicroBatchingPaddingThreads) {
  std::mt19937_64 rng(2);
  Problem p(rng);
  auto cpu = MakeCpu(p, true);
  const int64_t rows = 41;
  std::vector<float> x = RandomVector(rows * kK, 2.f, rng);
  const std::vector<float> y = Forward(*cpu, x);

  // Permutation.
  std::vector<int64_t> perm(rows);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<float> xp(rows * kK);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(x.begin() + perm[r] * kK, kK, xp.begin() + r * kK);
  }
  std::vector<float> yp = Forward(*cpu, xp);
  for (int64_t r = 0; r < rows; ++r) {
    ASSERT_EQ(0, std::memcmp(&yp[r * kN], &y[perm[r] * kN], kN * 4)) << r;
  }

  // Micro-batches of uneven sizes, and a padded batch (garbage rows around).
  std::vector<float> ym;
  for (int64_t begin = 0, step = 1; begin < rows; begin += step, step += 3) {
    const int64_t end = std::min(rows, begin + step);
    std::vector<float> part(x.begin() + begin * kK, x.begin() + end * kK);
    std::vector<float> yb = Forward(*cpu, part);
    ym.insert(ym.end(), yb.begin(), yb.end());
  }
  EXPECT_TRUE(SameBits(ym, y));
  std::vector<float> padded = RandomVector(5 * kK, 100.f, rng);
  padded.insert(padded.end(), x.begin(), x.end());
  std::vector<float> tail = RandomVector(7 * kK, 1e6f, rng);
  padded.insert(padded.end(), tail.begin(), tail.end());
  std::vector<float> ypad = Forward(*cpu, padded);
  EXPECT_EQ(0, std::memcmp(&ypad[5 * kN], y.data(), y.size() * 4));

  for (int threads : {1, 3, 7}) {
    EXPECT_TRUE(SameBits(Forward(*MakeCpu(p, true, threads), x), y));
  }
}

TEST(ProjectionCpuTest, BadShapesAreErrors) {
  std::mt19937_64 rng(3);
  Problem p(rng);
  ProjectionCpu::Options o;
  o.weight = absl::MakeConstSpan(p.weight).subspan(1);
  EXPECT_EQ(ProjectionCpu::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.weight = p.weight;
  o.bias = absl::MakeConstSpan(p.bias).subspan(0, 100);
  EXPECT_EQ(ProjectionCpu::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.bias = {};
  o.num_threads = -1;
  EXPECT_FALSE(ProjectionCpu::Create(o).ok());
  auto cpu = MakeCpu(p, true);
  std::vector<float> x(2 * kK, 1.f), y(2 * kN);
  EXPECT_TRUE(cpu->Forward(x, 2, absl::MakeSpan(y)).ok());
  EXPECT_FALSE(cpu->Forward(x, 3, absl::MakeSpan(y)).ok());
  EXPECT_FALSE(cpu->Forward(x, -1, absl::MakeSpan(y)).ok());
  EXPECT_FALSE(cpu->Forward(x, 2, absl::MakeSpan(y).subspan(1)).ok());
  EXPECT_FALSE(
      cpu->Forward(absl::MakeConstSpan(x).subspan(1), 2, absl::MakeSpan(y))
          .ok());
  EXPECT_TRUE(cpu->Forward({}, 0, {}).ok());
}

TEST(ProjectionGradTest, InputGradMatchesFloat64AndTheWrittenOrder) {
  std::mt19937_64 rng(4);
  Problem p(rng);
  const int64_t rows = 9;
  std::vector<float> dy = RandomVector(rows * kN, 1.f, rng);
  std::vector<float> dx(rows * kK, std::nanf(""));
  ASSERT_TRUE(ProjectionInputGrad(p.weight, dy, rows, absl::MakeSpan(dx)).ok());
  std::vector<double> ref(rows * kK);
  std::vector<float> exact(rows * kK);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < kK; ++k) {
      double d = 0;
      float total = 0.f;
      for (int64_t c = 0; c < kN / 128; ++c) {
        float part = 0.f;
        for (int64_t o = c * 128; o < c * 128 + 128; ++o) {
          d += static_cast<double>(dy[r * kN + o]) * p.weight[o * kK + k];
          part = std::fma(dy[r * kN + o], p.weight[o * kK + k], part);
        }
        total = total + part;
      }
      ref[r * kK + k] = d;
      exact[r * kK + k] = total;
    }
  }
  ExpectClose(dx, ref);
  EXPECT_TRUE(SameBits(dx, exact));
  // Rows are independent: the last 4 rows alone give the same bits.
  std::vector<float> dx_tail(4 * kK);
  ASSERT_TRUE(ProjectionInputGrad(
                  p.weight, absl::MakeConstSpan(dy).subspan((rows - 4) * kN), 4,
                  absl::MakeSpan(dx_tail), 3)
                  .ok());
  EXPECT_EQ(0, std::memcmp(dx_tail.data(), &dx[(rows - 4) * kK], 4 * kK * 4));
  EXPECT_FALSE(
      ProjectionInputGrad(p.weight, dy, rows + 1, absl::MakeSpan(dx)).ok());
  EXPECT_FALSE(ProjectionInputGrad(absl::MakeConstSpan(p.weight).subspan(96),
                                   dy, rows, absl::MakeSpan(dx))
                   .ok());
}

// Rows of a gradient problem, addressed by key.
struct GradRows {
  int64_t rows;
  std::vector<float> dy, x;
  std::vector<int64_t> keys;
  GradRows Select(const std::vector<int64_t>& idx) const {
    GradRows g{static_cast<int64_t>(idx.size()), {}, {}, {}};
    for (int64_t i : idx) {
      g.dy.insert(g.dy.end(), dy.begin() + i * kN, dy.begin() + (i + 1) * kN);
      g.x.insert(g.x.end(), x.begin() + i * kK, x.begin() + (i + 1) * kK);
      g.keys.push_back(keys[i]);
    }
    return g;
  }
};

GradRows RandomGradRows(int64_t rows, std::mt19937_64& rng) {
  GradRows g{rows,
             RandomVector(rows * kN, 1.f, rng),
             RandomVector(rows * kK, 1.f, rng),
             {}};
  g.keys.resize(rows);
  std::iota(g.keys.begin(), g.keys.end(), 0);
  return g;
}

ProjectionWeightGrads OneShot(const GradRows& g) {
  auto r = ComputeProjectionWeightGrads(g.dy, g.x, g.keys);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : ProjectionWeightGrads{};
}

TEST(ProjectionGradTest, WeightGradsMatchFloat64) {
  std::mt19937_64 rng(5);
  GradRows g = RandomGradRows(300, rng);  // 3 key chunks, the last partial
  ProjectionWeightGrads w = OneShot(g);
  std::vector<double> ref_w(kN * kK, 0.0), ref_b(kN, 0.0);
  for (int64_t r = 0; r < g.rows; ++r) {
    for (int64_t o = 0; o < kN; ++o) {
      const double d = g.dy[r * kN + o];
      ref_b[o] += d;
      for (int64_t k = 0; k < kK; ++k) ref_w[o * kK + k] += d * g.x[r * kK + k];
    }
  }
  ExpectClose(w.dweight, ref_w);
  ExpectClose(w.dbias, ref_b);
}

TEST(ProjectionGradTest, WeightGradBitsDependOnKeysNotOnRowOrderOrSplits) {
  std::mt19937_64 rng(6);
  const int64_t rows = 290;
  GradRows g = RandomGradRows(rows, rng);
  const ProjectionWeightGrads base = OneShot(g);

  std::vector<int64_t> perm(rows);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const GradRows shuffled = g.Select(perm);
  ProjectionWeightGrads s = OneShot(shuffled);
  EXPECT_TRUE(SameBits(s.dweight, base.dweight));
  EXPECT_TRUE(SameBits(s.dbias, base.dbias));

  // Shuffled rows in uneven micro-batches, key space unknown (fold at Finish)
  // and known (streaming), with 1 and 4 threads.
  for (int64_t key_count : {int64_t{0}, rows}) {
    for (int threads : {1, 4}) {
      ProjectionGradAccumulator::Options o;
      o.key_count = key_count;
      o.num_threads = threads;
      auto acc = ProjectionGradAccumulator::Create(o);
      ASSERT_TRUE(acc.ok());
      for (int64_t begin = 0, step = 13; begin < rows;
           begin += step, step *= 2) {
        std::vector<int64_t> idx;
        for (int64_t i = begin; i < std::min(rows, begin + step); ++i) {
          idx.push_back(i);
        }
        GradRows mb = shuffled.Select(idx);
        ASSERT_TRUE((*acc)->Add(mb.dy, mb.x, mb.keys).ok());
      }
      auto out = (*acc)->Finish();
      ASSERT_TRUE(out.ok());
      EXPECT_TRUE(SameBits(out->dweight, base.dweight)) << key_count;
      EXPECT_TRUE(SameBits(out->dbias, base.dbias)) << key_count;
      EXPECT_FALSE((*acc)->Finish().ok());
      EXPECT_FALSE((*acc)->Add({}, {}, {}).ok());
    }
  }

  // Sparse, huge keys: only their relative order and chunks matter, so
  // shifting all keys by a multiple of 128 keeps the bits.
  GradRows shifted = g;
  for (int64_t& k : shifted.keys) k += int64_t{128} << 33;
  ProjectionWeightGrads sh = OneShot(shifted);
  EXPECT_TRUE(SameBits(sh.dweight, base.dweight));
}

TEST(ProjectionGradTest, WeightGradsFollowTheWrittenThreeLevelOrder) {
  std::mt19937_64 rng(9);
  // Sparse keys over five superchunks (4096 keys each), some chunks empty.
  std::vector<int64_t> keys;
  std::uniform_int_distribution<int64_t> pick(0, 5 * 4096 - 1);
  while (keys.size() < 160) {
    const int64_t k =
        keys.size() < 40 ? static_cast<int64_t>(keys.size()) : pick(rng);
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  }
  std::shuffle(keys.begin(), keys.end(), rng);
  GradRows g = RandomGradRows(static_cast<int64_t>(keys.size()), rng);
  g.keys = keys;

  // The contract, transcribed literally.
  std::vector<int64_t> order(keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  std::vector<float> dw(kN * kK, 0.f), db(kN, 0.f);
  std::vector<float> sw(kN * kK, 0.f), sb(kN, 0.f);
  std::vector<float> pw(kN * kK, 0.f), pb(kN, 0.f);
  auto fold_chunk = [&] {
    for (int64_t i = 0; i < kN * kK; ++i) sw[i] = sw[i] + pw[i], pw[i] = 0.f;
    for (int64_t o = 0; o < kN; ++o) sb[o] = sb[o] + pb[o], pb[o] = 0.f;
  };
  auto fold_super = [&] {
    for (int64_t i = 0; i < kN * kK; ++i) dw[i] = dw[i] + sw[i], sw[i] = 0.f;
    for (int64_t o = 0; o < kN; ++o) db[o] = db[o] + sb[o], sb[o] = 0.f;
  };
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t r = order[i], key = keys[r];
    for (int64_t o = 0; o < kN; ++o) {
      for (int64_t k = 0; k < kK; ++k) {
        pw[o * kK + k] =
            std::fma(g.dy[r * kN + o], g.x[r * kK + k], pw[o * kK + k]);
      }
      pb[o] = pb[o] + g.dy[r * kN + o];
    }
    const bool last = i + 1 == order.size();
    const int64_t next = last ? -1 : keys[order[i + 1]];
    if (last || next / 128 != key / 128) fold_chunk();
    if (last || next / 4096 != key / 4096) fold_super();
  }
  ProjectionWeightGrads w = OneShot(g);
  EXPECT_TRUE(SameBits(w.dweight, dw));
  EXPECT_TRUE(SameBits(w.dbias, db));

  // Streaming with a known key space, in three unordered micro-batches.
  ProjectionGradAccumulator::Options o;
  o.key_count = 5 * 4096;
  auto acc = ProjectionGradAccumulator::Create(o);
  ASSERT_TRUE(acc.ok());
  for (int64_t b = 0; b < 3; ++b) {
    std::vector<int64_t> idx;
    for (int64_t i = b; i < g.rows; i += 3) idx.push_back(i);
    GradRows mb = g.Select(idx);
    ASSERT_TRUE((*acc)->Add(mb.dy, mb.x, mb.keys).ok());
  }
  auto out = (*acc)->Finish();
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE(SameBits(out->dweight, dw));
  EXPECT_TRUE(SameBits(out->dbias, db));
}

TEST(ProjectionGradTest, StreamingInKeyOrderKeepsMemoryBounded) {
  std::mt19937_64 rng(7);
  const int64_t rows = 700;
  GradRows g = RandomGradRows(rows, rng);
  const ProjectionWeightGrads base = OneShot(g);
  ProjectionGradAccumulator::Options o;
  o.key_count = rows;
  o.max_buffered_rows = 256;
  auto acc = ProjectionGradAccumulator::Create(o);
  ASSERT_TRUE(acc.ok());
  // Micro-batches of 100 rows, in key order, shuffled inside: at most two
  // partially filled chunks wait at any time.
  for (int64_t begin = 0; begin < rows; begin += 100) {
    std::vector<int64_t> idx(100);
    std::iota(idx.begin(), idx.end(), begin);
    std::shuffle(idx.begin(), idx.end(), rng);
    GradRows mb = g.Select(idx);
    ASSERT_TRUE((*acc)->Add(mb.dy, mb.x, mb.keys).ok());
    EXPECT_LT((*acc)->buffered_rows(), 128);
  }
  auto out = (*acc)->Finish();
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE(SameBits(out->dweight, base.dweight));
  EXPECT_TRUE(SameBits(out->dbias, base.dbias));
}

TEST(ProjectionGradTest, BadKeysAndLimitsAreErrorsThatLeaveStateUnchanged) {
  std::mt19937_64 rng(8);
  GradRows g = RandomGradRows(200, rng);
  ProjectionGradAccumulator::Options o;
  o.key_count = 200;
  o.max_buffered_rows = 128;
  auto acc = ProjectionGradAccumulator::Create(o);
  ASSERT_TRUE(acc.ok());
  auto& a = **acc;
  auto add = [&](const std::vector<int64_t>& idx, std::vector<int64_t> keys) {
    GradRows mb = g.Select(idx);
    return a.Add(mb.dy, mb.x, keys);
  };
  EXPECT_EQ(add({0, 1}, {0, 0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(add({0}, {-1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(add({0}, {200}).code(), absl::StatusCode::kInvalidArgument);
  // Keys 150..199 can't fold before chunk 0: 50 rows wait. Then 100 more of
  // chunk 0 would make 150 > 128 wait: refused, nothing changes.
  std::vector<int64_t> hi(50), lo(100);
  std::iota(hi.begin(), hi.end(), 150);
  std::iota(lo.begin(), lo.end(), 0);
  ASSERT_TRUE(add(hi, hi).ok());
  EXPECT_EQ(add(lo, lo).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(a.buffered_rows(), 50);
  EXPECT_EQ(add({150}, {150}).code(), absl::StatusCode::kInvalidArgument);
  // 128 rows completing chunk 0 fold at once, so they fit.
  std::vector<int64_t> chunk0(128);
  std::iota(chunk0.begin(), chunk0.end(), 0);
  ASSERT_TRUE(add(chunk0, chunk0).ok());
  EXPECT_EQ(a.buffered_rows(), 50);
  EXPECT_EQ(add({5}, {5}).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int64_t> mid(22);
  std::iota(mid.begin(), mid.end(), 128);
  ASSERT_TRUE(add(mid, mid).ok());
  EXPECT_EQ(a.buffered_rows(), 0);
  auto out = a.Finish();
  ASSERT_TRUE(out.ok());
  ProjectionWeightGrads base = OneShot(g);
  EXPECT_TRUE(SameBits(out->dweight, base.dweight));
  EXPECT_TRUE(SameBits(out->dbias, base.dbias));

  EXPECT_FALSE(ComputeProjectionWeightGrads(
                   absl::MakeConstSpan(g.dy).subspan(1), g.x, g.keys)
                   .ok());
  o.max_buffered_rows = 1;
  EXPECT_FALSE(ProjectionGradAccumulator::Create(o).ok());
  o.max_buffered_rows = 128;
  o.key_count = -5;
  EXPECT_FALSE(ProjectionGradAccumulator::Create(o).ok());
}

}  // namespace
}  // namespace detlogp::kernels
