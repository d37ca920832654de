// Checks of the entropy and top-k outputs shared by the tests of
// both linear-logp kernels (linear_logp_cuda_test.cu: the Hopper kernel;
// linear_logp_portable_test.cu: the portable one): bitwise batch invariance
// (memcmp) and float64 references, each a function of the kernel kind.
#ifndef DETLOGP_TESTS_CUDA_LINEAR_LOGP_EXTRAS_CHECKS_CUH_
#define DETLOGP_TESTS_CUDA_LINEAR_LOGP_EXTRAS_CHECKS_CUH_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "tests/cuda/linear_logp_test_support.cuh"

namespace detlogp::kernels::cuda {

struct Extras {
  std::vector<float> logprobs, lse, entropy, top_logprobs;
  std::vector<int32_t> top_ids;
  int32_t k = 0;
};

// Rows [start, start + count) with entropy (when `entropy`) and top-k; the
// outputs are poisoned first.
inline Extras RunExtras(const LinearLogpCuda& kernel, const Batch& batch,
                        int64_t start, int64_t count, bool entropy,
                        int32_t top_k, cudaStream_t stream = nullptr) {
  DevBuf<float> lp(count), lse(count), ent(count), top_lp(count * top_k);
  DevBuf<int32_t> top_ids(count * top_k);
  DevBuf<uint8_t> ws(
      std::max<size_t>(kernel.WorkspaceBytes(count, entropy, top_k), 1));
  for (auto [ptr, bytes] : {std::pair<void*, size_t>{lp.ptr, count * 4},
                            {lse.ptr, count * 4},
                            {ent.ptr, count * 4},
                            {top_lp.ptr, count * top_k * 4},
                            {top_ids.ptr, count * top_k * 4},
                            {ws.ptr, ws.n}}) {
    CUDA_CHECK_THROW(cudaMemsetAsync(ptr, 0xFF, bytes, stream));
  }
  LinearLogpBatchView view{batch.hidden.ptr + start * batch.H,
                           batch.targets.ptr + start,
                           batch.temps.ptr + start,
                           lp.ptr,
                           lse.ptr,
                           count};
  view.entropy = entropy ? ent.ptr : nullptr;
  view.top_k = top_k;
  view.top_ids = top_ids.ptr;
  view.top_logprobs = top_lp.ptr;
  const absl::Status st = kernel.Launch(view, ws.ptr, stream);
  EXPECT_TRUE(st.ok()) << st;
  CUDA_CHECK_THROW(cudaStreamSynchronize(stream));
  Extras out{lp.ToHost(),     lse.ToHost(),     ent.ToHost(),
             top_lp.ToHost(), top_ids.ToHost(), top_k};
  if (!entropy) out.entropy.clear();
  return out;
}

// Row ia of `a` and row ib of `b` have the same bits in every output both
// computed (top lists: b's k entries are a prefix of a's).
inline void ExpectSameExtras(const Extras& a, int64_t ia, const Extras& b,
                             int64_t ib, const std::string& what) {
  EXPECT_TRUE(SameBits(a.logprobs[ia], b.logprobs[ib]) &&
              SameBits(a.lse[ia], b.lse[ib]))
      << what << ": logprob/lse of row " << ia << " vs " << ib;
  if (!a.entropy.empty() && !b.entropy.empty()) {
    EXPECT_TRUE(SameBits(a.entropy[ia], b.entropy[ib]))
        << what << ": entropy of row " << ia << " vs " << ib << ": "
        << a.entropy[ia] << " vs " << b.entropy[ib];
  }
  const int32_t k = std::min(a.k, b.k);
  for (int32_t i = 0; i < k; ++i) {
    EXPECT_EQ(a.top_ids[ia * a.k + i], b.top_ids[ib * b.k + i])
        << what << ": top id " << i << " of row " << ia << " vs " << ib;
    EXPECT_TRUE(
        SameBits(a.top_logprobs[ia * a.k + i], b.top_logprobs[ib * b.k + i]))
        << what << ": top logprob " << i << " of row " << ia << " vs " << ib;
  }
}

struct RowReference {
  double entropy;
  std::vector<std::pair<double, int32_t>> ranked;  // (logprob, id), best first
};

// float64 entropy and full ranking of the given rows.
inline std::vector<RowReference> ReferenceExtras(
    const Weights& w, const Batch& b, const std::vector<int64_t>& rows) {
  const int64_t H = w.H, V = w.V;
  std::vector<float> wf(w.host_w.size());
  for (size_t i = 0; i < wf.size(); ++i) wf[i] = Bf16ToFloat(w.host_w[i]);
  std::vector<RowReference> out;
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  for (int64_t r : rows) {
    std::vector<double> h(H), z(V);
    for (int64_t k = 0; k < H; ++k)
      h[k] = Bf16ToFloat(b.host_hidden[r * H + k]);
    const double t = b.host_temps[r];
    std::vector<std::thread> pool;
    for (int ti = 0; ti < threads; ++ti) {
      pool.emplace_back([&, ti] {
        for (int64_t v = ti; v < V; v += threads) {
          double acc = 0.0;
          for (int64_t k = 0; k < H; ++k) acc += h[k] * wf[v * H + k];
          if (w.has_bias) acc += w.host_b[v];
          z[v] = acc / t;
        }
      });
    }
    for (auto& th : pool) th.join();
    double m = -INFINITY;
    for (double x : z) m = std::max(m, x);
    double sum = 0.0, sum_z = 0.0;
    for (double x : z) {
      sum += std::exp(x - m);
      sum_z += std::exp(x - m) * x;
    }
    const double lse = m + std::log(sum);
    RowReference ref{lse - sum_z / sum, {}};
    for (int64_t v = 0; v < V; ++v)
      ref.ranked.push_back({z[v] - lse, static_cast<int32_t>(v)});
    std::sort(ref.ranked.begin(), ref.ranked.end(),
              [](const auto& x, const auto& y) {
                return x.first > y.first ||
                       (x.first == y.first && x.second < y.second);
              });
    out.push_back(std::move(ref));
  }
  return out;
}

// Entropy within 2e-3; top-k ids equal the float64 ranking wherever the
// neighbouring gaps exceed 1e-4, log-probs within 1e-3.
inline void ExpectExtrasAccurate(const Weights& w, const Batch& b,
                                 const Extras& res, int64_t offset,
                                 const std::vector<int64_t>& rows) {
  const std::vector<RowReference> refs = ReferenceExtras(w, b, rows);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i] - offset;
    const RowReference& ref = refs[i];
    if (!res.entropy.empty()) {
      EXPECT_LE(std::fabs(res.entropy[r] - ref.entropy), 2e-3)
          << "row " << rows[i] << " entropy " << res.entropy[r] << " ref "
          << ref.entropy;
    }
    for (int32_t j = 0; j < res.k; ++j) {
      const double gap_before =
          j > 0 ? ref.ranked[j - 1].first - ref.ranked[j].first : 1.0;
      const double gap_after = ref.ranked[j].first - ref.ranked[j + 1].first;
      if (gap_before > 1e-4 && gap_after > 1e-4) {
        EXPECT_EQ(res.top_ids[r * res.k + j], ref.ranked[j].second)
            << "row " << rows[i] << " rank " << j;
      }
      EXPECT_LE(
          std::fabs(res.top_logprobs[r * res.k + j] - ref.ranked[j].first),
          1e-3)
          << "row " << rows[i] << " rank " << j;
      const int32_t id = res.top_ids[r * res.k + j];
      EXPECT_TRUE(id >= 0 && id < w.V) << "row " << rows[i] << " id " << id;
    }
    for (int32_t j = 1; j < res.k; ++j) {
      EXPECT_GE(res.top_logprobs[r * res.k + j - 1],
                res.top_logprobs[r * res.k + j])
          << "row " << rows[i] << ": not descending at " << j;
    }
  }
}

// Asking for entropy or top-k never changes a row's logprob or lse bits.
inline void ExpectExtrasNeverChangeLogprobBits(const Weights& w,
                                               KernelKind kernel) {
  auto k = MakeKernelOf(kernel, w);
  ASSERT_NE(k, nullptr);
  auto batch = MakeBatch(700, w.H, w.V);
  const Extras plain = RunExtras(*k, *batch, 0, batch->N, false, 0);
  for (auto [entropy, top_k] :
       {std::pair{true, 0}, {false, 20}, {true, 32}, {true, 1}}) {
    const Extras with = RunExtras(*k, *batch, 0, batch->N, entropy, top_k);
    EXPECT_EQ(0, std::memcmp(with.logprobs.data(), plain.logprobs.data(),
                             batch->N * 4))
        << "entropy=" << entropy << " top_k=" << top_k;
    EXPECT_EQ(0, std::memcmp(with.lse.data(), plain.lse.data(), batch->N * 4))
        << "entropy=" << entropy << " top_k=" << top_k;
  }
}

// A row's entropy and top-k alone equal the row's at any position, in any
// chunking, on two streams; and they are accurate.
inline void ExpectExtrasOfARowAloneEqualTheRowAnywhere(const Weights& w,
                                                       KernelKind kernel) {
  auto k = MakeKernelOf(kernel, w);
  ASSERT_NE(k, nullptr);
  auto batch = MakeBatch(1100, w.H, w.V);
  const Extras all = RunExtras(*k, *batch, 0, batch->N, true, 20);
  const Extras all_entropy = RunExtras(*k, *batch, 0, batch->N, true, 0);
  for (int64_t probe :
       {int64_t{0}, int64_t{127}, int64_t{128}, int64_t{555}, int64_t{1099}}) {
    const Extras alone = RunExtras(*k, *batch, probe, 1, true, 20);
    ExpectSameExtras(all, probe, alone, 0, "alone vs in 1100");
    // Entropy alone: a small batch's schedule against a large one's.
    const Extras entropy_alone = RunExtras(*k, *batch, probe, 1, true, 0);
    ExpectSameExtras(all_entropy, probe, entropy_alone, 0,
                     "entropy alone vs in 1100");
  }
  // Chunkings and a smaller k: prefixes of the same bits.
  for (int64_t chunk :
       {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{129}, int64_t{512}}) {
    for (int64_t start = 0; start < std::min<int64_t>(batch->N, 4 * chunk);
         start += chunk) {
      const int64_t n = std::min(chunk, batch->N - start);
      const Extras part = RunExtras(*k, *batch, start, n, chunk % 2 == 1, 5);
      for (int64_t i = 0; i < n; ++i) {
        ExpectSameExtras(all, start + i, part, i,
                         "chunk " + std::to_string(chunk));
      }
    }
  }
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreate(&s1));
  CUDA_OK(cudaStreamCreate(&s2));
  const Extras a = RunExtras(*k, *batch, 0, batch->N, true, 20, s1);
  const Extras b = RunExtras(*k, *batch, 0, batch->N, true, 20, s2);
  for (int64_t i = 0; i < batch->N; ++i)
    ExpectSameExtras(a, i, b, i, "two streams");
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
  ExpectExtrasAccurate(w, *batch, all, 0, {0, 1, 2, 500, 1099});
}

// Small vocabularies: splits narrower than k, one split, padding rows with
// huge logits that must never be chosen, bias and temperature.
inline void ExpectExtrasOfSmallVocabulariesAndPadding(KernelKind kernel) {
  for (auto [H, V, Vpad, top_k] :
       {std::tuple<int64_t, int64_t, int64_t, int32_t>{64, 40, 64, 32},
        {128, 100, 128, 32},
        {64, 4097, 4160, 20},
        {256, 9000, 9000, 7},
        {64, 32, 32, 32}}) {
    auto w = MakeWeights(H, V, Vpad, /*bias=*/true);
    auto batch = MakeBatch(300, H, V);
    auto k = MakeKernelOf(kernel, *w);
    ASSERT_NE(k, nullptr);
    ASSERT_NE(k, nullptr);
    const Extras all = RunExtras(*k, *batch, 0, batch->N, true, top_k);
    ExpectExtrasAccurate(*w, *batch, all, 0, {0, 1, 150, 299});
    const Extras alone = RunExtras(*k, *batch, 150, 1, true, top_k);
    ExpectSameExtras(all, 150, alone, 0, "V=" + std::to_string(V));
  }
}

// A flat row (every logit equal: hidden 0, no bias) has entropy log V and
// top-k = the k lowest ids; a peaked row (one logit far above the rest) has
// entropy ~0 and that token first.
inline void ExpectExtrasOfFlatAndPeakedRows(KernelKind kernel) {
  const int64_t H = 128, V = 50000;
  auto w = MakeWeights(H, V, V, /*bias=*/false);
  auto batch = MakeBatch(4, H, V, /*unit_temperature=*/true);
  std::fill(batch->host_hidden.begin(), batch->host_hidden.begin() + H,
            uint16_t{0});
  // Row 1: the hidden state is 60 x weight row 777, so z[777] >> the rest.
  for (int64_t i = 0; i < H; ++i) {
    batch->host_hidden[H + i] = FloatToBf16(
        60.0f * Bf16ToFloat(w->host_w[777 * H + i]) / 0.02f / 0.02f / H);
  }
  batch->Upload();
  auto k = MakeKernelOf(kernel, *w);
  ASSERT_NE(k, nullptr);
  const Extras out = RunExtras(*k, *batch, 0, batch->N, true, 32);
  EXPECT_NEAR(out.entropy[0], std::log(static_cast<double>(V)), 2e-3);
  for (int32_t j = 0; j < 32; ++j)
    EXPECT_EQ(out.top_ids[j], j) << "flat row rank " << j;
  EXPECT_EQ(out.top_ids[32], 777);
  EXPECT_LT(out.entropy[1], 0.05);
  ExpectExtrasAccurate(*w, *batch, out, 0, {0, 1, 2, 3});
}

inline void ExpectBadTopKRejected(KernelKind kernel) {
  auto w = MakeWeights(64, 40, 64, false);
  auto batch = MakeBatch(4, 64, 40);
  auto k = MakeKernelOf(kernel, *w);
  ASSERT_NE(k, nullptr);
  DevBuf<float> lp(4), lse(4), top_lp(4 * 64);
  DevBuf<int32_t> top_ids(4 * 64);
  DevBuf<uint8_t> ws(k->WorkspaceBytes(4, true, 64));
  for (int32_t bad : {-1, 33, 41}) {
    LinearLogpBatchView view{batch->hidden.ptr, batch->targets.ptr,
                             batch->temps.ptr,  lp.ptr,
                             lse.ptr,           4};
    view.top_k = bad;
    view.top_ids = top_ids.ptr;
    view.top_logprobs = top_lp.ptr;
    EXPECT_FALSE(k->Launch(view, ws.ptr, nullptr).ok()) << bad;
  }
}

}  // namespace detlogp::kernels::cuda

#endif  // DETLOGP_TESTS_CUDA_LINEAR_LOGP_EXTRAS_CHECKS_CUH_
