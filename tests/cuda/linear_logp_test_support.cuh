// Shared by the GPU tests of the linear-logp kernels (the Hopper kernel's
// linear_logp_cuda_test.cu and the portable kernel's
// linear_logp_portable_test.cu): device RNG, buffers, random weights and
// batches, a runner that poisons and checks outputs, and the float64
// reference. Included by one test source per binary.
#ifndef DETLOGP_TESTS_CUDA_LINEAR_LOGP_TEST_SUPPORT_CUH_
#define DETLOGP_TESTS_CUDA_LINEAR_LOGP_TEST_SUPPORT_CUH_

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
#include <thread>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/cuda/linear_logp_cuda.h"

namespace detlogp::kernels::cuda {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr
#define CUDA_CHECK_THROW(expr)                                                \
  do {                                                                        \
    cudaError_t e_ = (expr);                                                  \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::abort();                                                           \
    }                                                                         \
  } while (0)

// The kernel needs a compute-capability-9.0 device; without one (CI machines)
// every test is skipped, with the reason.
inline bool HaveSm90() {
  static const bool have = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      return false;
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
    return prop.major == 9 && prop.minor == 0;
  }();
  return have;
}

#define REQUIRE_SM90()                                              \
  do {                                                              \
    if (!HaveSm90()) GTEST_SKIP() << "needs an sm_90 (Hopper) GPU"; \
  } while (0)

inline uint64_t FreshSeed() {
  static const uint64_t base = [] {
    std::random_device rd;
    const uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    std::printf("[linear_logp test] seed base = %llu\n",
                static_cast<unsigned long long>(s));
    return s;
  }();
  static uint64_t counter = 0;
  return base + 0x9E3779B97F4A7C15ull * (++counter);
}

// ------------------------------------------------------------------ RNG
__device__ __forceinline__ uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

__device__ __forceinline__ float Normal(uint64_t seed, uint64_t i) {
  const uint64_t a = Mix(seed ^ Mix(2 * i + 1));
  const uint64_t b = Mix(seed ^ Mix(2 * i + 2));
  const float u1 = (static_cast<float>(a >> 40) + 1.0f) * (1.0f / 16777217.0f);
  const float u2 = static_cast<float>(b >> 40) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__global__ void FillNormalBf16(__nv_bfloat16* out, int64_t n, uint64_t seed,
                               float sigma) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16_rn(sigma * Normal(seed, i));
  }
}

__global__ void FillConstBf16(__nv_bfloat16* out, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16_rn(v);
  }
}

__global__ void FillNormalF32(float* out, int64_t n, uint64_t seed,
                              float sigma) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = sigma * Normal(seed, i);
  }
}

// ------------------------------------------------------------------ buffers
template <typename T>
struct DevBuf {
  T* ptr = nullptr;
  int64_t n = 0;
  DevBuf() = default;
  explicit DevBuf(int64_t count) : n(count) {
    CUDA_CHECK_THROW(cudaMalloc(&ptr, std::max<int64_t>(count, 1) * sizeof(T)));
  }
  ~DevBuf() {
    if (ptr) cudaFree(ptr);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : ptr(o.ptr), n(o.n) { o.ptr = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(n, o.n);
    return *this;
  }
  std::vector<T> ToHost() const {
    std::vector<T> h(n);
    CUDA_CHECK_THROW(
        cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void FromHost(const std::vector<T>& h) {
    CUDA_CHECK_THROW(
        cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
};

struct Weights {
  int64_t H, V, Vpad;
  bool has_bias;
  DevBuf<__nv_bfloat16> w;
  DevBuf<float> b;
  std::vector<uint16_t> host_w;  // first V rows only
  std::vector<float> host_b;

  LinearLogpWeightsView View() const {
    return LinearLogpWeightsView{w.ptr, has_bias ? b.ptr : nullptr, H, V, Vpad};
  }
};

// Real rows ~ N(0, 0.02^2), bias ~ N(0, 0.1^2). Padding rows are set to 1.0
// and their bias to 50 so that counting them would wreck the results.
inline std::unique_ptr<Weights> MakeWeights(int64_t H, int64_t V, int64_t Vpad,
                                            bool bias) {
  auto w = std::make_unique<Weights>();
  w->H = H;
  w->V = V;
  w->Vpad = Vpad;
  w->has_bias = bias;
  w->w = DevBuf<__nv_bfloat16>(Vpad * H);
  w->b = DevBuf<float>(Vpad);
  FillNormalBf16<<<1024, 256>>>(w->w.ptr, V * H, FreshSeed(), 0.02f);
  if (Vpad > V)
    FillConstBf16<<<256, 256>>>(w->w.ptr + V * H, (Vpad - V) * H, 1.0f);
  FillNormalF32<<<256, 256>>>(w->b.ptr, Vpad, FreshSeed(), 0.1f);
  CUDA_CHECK_THROW(cudaDeviceSynchronize());
  if (Vpad > V) {
    std::vector<float> pad(Vpad - V, 50.0f);
    CUDA_CHECK_THROW(cudaMemcpy(w->b.ptr + V, pad.data(), pad.size() * 4,
                                cudaMemcpyHostToDevice));
  }
  w->host_w.resize(V * H);
  CUDA_CHECK_THROW(cudaMemcpy(w->host_w.data(), w->w.ptr, V * H * 2,
                              cudaMemcpyDeviceToHost));
  w->host_b = w->b.ToHost();
  return w;
}

// Tests at the production shape (H 4096, V 151936 padded to 152064, with
// bias): the weights are made once per test suite.
class FullVocabTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!HaveSm90()) return;
    weights_ = MakeWeights(4096, 151936, 152064, /*bias=*/true).release();
  }
  static void TearDownTestSuite() {
    delete weights_;
    weights_ = nullptr;
  }
  inline static Weights* weights_ = nullptr;
};

struct Batch {
  int64_t N, H;
  DevBuf<__nv_bfloat16> hidden;
  DevBuf<int32_t> targets;
  DevBuf<float> temps;
  std::vector<uint16_t> host_hidden;
  std::vector<int32_t> host_targets;
  std::vector<float> host_temps;

  void Upload() {
    CUDA_CHECK_THROW(cudaMemcpy(hidden.ptr, host_hidden.data(), N * H * 2,
                                cudaMemcpyHostToDevice));
    targets.FromHost(host_targets);
    temps.FromHost(host_temps);
  }
};

inline std::unique_ptr<Batch> MakeBatch(int64_t N, int64_t H, int64_t V,
                                        bool unit_temperature = false) {
  auto b = std::make_unique<Batch>();
  b->N = N;
  b->H = H;
  b->hidden = DevBuf<__nv_bfloat16>(N * H);
  b->targets = DevBuf<int32_t>(N);
  b->temps = DevBuf<float>(N);
  FillNormalBf16<<<1024, 256>>>(b->hidden.ptr, N * H, FreshSeed(), 1.0f);
  CUDA_CHECK_THROW(cudaDeviceSynchronize());
  b->host_hidden.resize(N * H);
  CUDA_CHECK_THROW(cudaMemcpy(b->host_hidden.data(), b->hidden.ptr, N * H * 2,
                              cudaMemcpyDeviceToHost));
  std::mt19937_64 rng(FreshSeed());
  std::uniform_int_distribution<int32_t> tgt(0, static_cast<int32_t>(V - 1));
  std::uniform_real_distribution<float> temp(0.5f, 2.0f);
  b->host_targets.resize(N);
  b->host_temps.resize(N);
  for (int64_t i = 0; i < N; ++i) {
    b->host_targets[i] = tgt(rng);
    b->host_temps[i] = unit_temperature ? 1.0f : temp(rng);
  }
  // Make sure the vocabulary edges are hit as targets too.
  if (N > 2) {
    b->host_targets[0] = 0;
    b->host_targets[1] = static_cast<int32_t>(V - 1);
  }
  b->Upload();
  return b;
}

struct Result {
  std::vector<float> logprobs, lse;
};

// Runs rows [start, start + count) of `batch`; outputs are poisoned (all-ones
// bytes, a NaN) first and every element is checked to be written.
inline Result RunRows(const LinearLogpCuda& k, const Batch& batch,
                      int64_t start, int64_t count,
                      cudaStream_t stream = nullptr) {
  DevBuf<float> lp(count), lse(count);
  DevBuf<uint8_t> ws(std::max<size_t>(k.WorkspaceBytes(count), 1));
  CUDA_CHECK_THROW(cudaMemsetAsync(lp.ptr, 0xFF, count * 4, stream));
  CUDA_CHECK_THROW(cudaMemsetAsync(lse.ptr, 0xFF, count * 4, stream));
  CUDA_CHECK_THROW(cudaMemsetAsync(ws.ptr, 0xFF, ws.n, stream));
  LinearLogpBatchView view{batch.hidden.ptr + start * batch.H,
                           batch.targets.ptr + start,
                           batch.temps.ptr + start,
                           lp.ptr,
                           lse.ptr,
                           count};
  const absl::Status s = k.Launch(view, ws.ptr, stream);
  EXPECT_TRUE(s.ok()) << s;
  CUDA_CHECK_THROW(cudaStreamSynchronize(stream));
  Result r{lp.ToHost(), lse.ToHost()};
  for (int64_t i = 0; i < count; ++i) {
    EXPECT_TRUE(std::isfinite(r.logprobs[i]) && std::isfinite(r.lse[i]))
        << "row " << start + i << " not written or not finite";
  }
  return r;
}

inline bool SameBits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

inline void ExpectRowBits(const Result& a, int64_t ia, const Result& b,
                          int64_t ib, const char* what) {
  EXPECT_TRUE(SameBits(a.logprobs[ia], b.logprobs[ib]) &&
              SameBits(a.lse[ia], b.lse[ib]))
      << what << ": row " << ia << " vs " << ib << " logprob " << a.logprobs[ia]
      << " vs " << b.logprobs[ib] << ", lse " << a.lse[ia] << " vs "
      << b.lse[ib];
}

// float64 reference for the given rows (threads over rows x vocab).
inline void Reference(const Weights& w, const Batch& b,
                      const std::vector<int64_t>& rows,
                      std::vector<double>* ref_lp,
                      std::vector<double>* ref_lse) {
  const int64_t H = w.H, V = w.V;
  std::vector<float> wf(w.host_w.size());
  for (size_t i = 0; i < wf.size(); ++i) wf[i] = Bf16ToFloat(w.host_w[i]);
  ref_lp->assign(rows.size(), 0.0);
  ref_lse->assign(rows.size(), 0.0);
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    const int64_t r = rows[ri];
    std::vector<double> h(H);
    for (int64_t k = 0; k < H; ++k)
      h[k] = Bf16ToFloat(b.host_hidden[r * H + k]);
    std::vector<double> z(V);
    const double t = b.host_temps[r];
    std::vector<std::thread> pool;
    for (int ti = 0; ti < threads; ++ti) {
      pool.emplace_back([&, ti] {
        for (int64_t v = ti; v < V; v += threads) {
          const float* wr = wf.data() + v * H;
          double acc = 0.0;
          for (int64_t k = 0; k < H; ++k) acc += h[k] * wr[k];
          if (w.has_bias) acc += w.host_b[v];
          z[v] = acc / t;
        }
      });
    }
    for (auto& th : pool) th.join();
    double m = -INFINITY;
    for (double x : z) m = std::max(m, x);
    double s = 0.0;
    for (double x : z) s += std::exp(x - m);
    const double lse = m + std::log(s);
    (*ref_lse)[ri] = lse;
    (*ref_lp)[ri] = z[b.host_targets[r]] - lse;
  }
}

inline void ExpectAccurate(const Weights& w, const Batch& b, const Result& res,
                           int64_t res_offset,
                           const std::vector<int64_t>& rows) {
  std::vector<double> lp, lse;
  Reference(w, b, rows, &lp, &lse);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i];
    EXPECT_LE(std::fabs(res.logprobs[r - res_offset] - lp[i]), 1e-3)
        << "row " << r << " logprob " << res.logprobs[r - res_offset] << " ref "
        << lp[i];
    EXPECT_LE(std::fabs(res.lse[r - res_offset] - lse[i]), 1e-3)
        << "row " << r << " lse " << res.lse[r - res_offset] << " ref "
        << lse[i];
  }
}

inline std::unique_ptr<LinearLogpCuda> MakeKernelOf(
    KernelKind kernel, const Weights& w,
    SplitMode mode = SplitMode::kBatchInvariant) {
  LinearLogpCuda::Options o;
  o.weights = w.View();
  o.split = mode;
  o.kernel = kernel;
  auto k = LinearLogpCuda::Create(o);
  EXPECT_TRUE(k.ok()) << k.status();
  return k.ok() ? std::move(*k) : nullptr;
}

// A Hopper kernel on `w` with the options `adjust` sets (floors, ...).
template <typename Adjust>
std::unique_ptr<LinearLogpCuda> MakeKernelWith(const Weights& w,
                                               Adjust adjust) {
  LinearLogpCuda::Options o;
  o.weights = w.View();
  adjust(o);
  auto k = LinearLogpCuda::Create(o);
  EXPECT_TRUE(k.ok()) << k.status();
  return k.ok() ? std::move(*k) : nullptr;
}

// The same batch launched concurrently on two streams, three times, equals
// itself and a plain run, bit for bit.
inline void ExpectTwoStreamsAndRepeatsAgree(const LinearLogpCuda& k,
                                            const Weights& w) {
  const int64_t N = 1000;
  auto batch = MakeBatch(N, 4096, w.V);
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  // Concurrent launches of the same batch on two streams.
  DevBuf<float> lp1(N), lse1(N), lp2(N), lse2(N);
  DevBuf<uint8_t> ws1(k.WorkspaceBytes(N)), ws2(k.WorkspaceBytes(N));
  for (int rep = 0; rep < 3; ++rep) {
    CUDA_OK(cudaMemsetAsync(lp1.ptr, 0xFF, N * 4, s1));
    CUDA_OK(cudaMemsetAsync(lp2.ptr, 0xFF, N * 4, s2));
    LinearLogpBatchView v1{batch->hidden.ptr, batch->targets.ptr,
                           batch->temps.ptr,  lp1.ptr,
                           lse1.ptr,          N};
    LinearLogpBatchView v2{batch->hidden.ptr, batch->targets.ptr,
                           batch->temps.ptr,  lp2.ptr,
                           lse2.ptr,          N};
    ASSERT_TRUE(k.Launch(v1, ws1.ptr, s1).ok());
    ASSERT_TRUE(k.Launch(v2, ws2.ptr, s2).ok());
    CUDA_OK(cudaStreamSynchronize(s1));
    CUDA_OK(cudaStreamSynchronize(s2));
    const Result a{lp1.ToHost(), lse1.ToHost()};
    const Result b{lp2.ToHost(), lse2.ToHost()};
    const Result c = RunRows(k, *batch, 0, N);
    EXPECT_EQ(std::memcmp(a.logprobs.data(), b.logprobs.data(), N * 4), 0);
    EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), N * 4), 0);
    EXPECT_EQ(std::memcmp(a.logprobs.data(), c.logprobs.data(), N * 4), 0);
    EXPECT_EQ(std::memcmp(a.lse.data(), c.lse.data(), N * 4), 0);
  }
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
}

// int64 targets and one scalar temperature give the bits of int32 targets
// and a [rows] temperature array; a target outside [0, V) gives NaN; a bad
// scalar temperature is refused on the host.
inline void ExpectInt64TargetsAndScalarTemperatureKeepBits(KernelKind kernel) {
  auto w = MakeWeights(128, 1000, 1024, /*bias=*/true);
  auto batch = MakeBatch(300, 128, 1000);
  for (float& t : batch->host_temps) t = 0.7f;
  batch->Upload();
  auto k = MakeKernelOf(kernel, *w);
  ASSERT_NE(k, nullptr);
  const Result want = RunRows(*k, *batch, 0, batch->N);
  std::vector<int64_t> wide(batch->host_targets.begin(),
                            batch->host_targets.end());
  wide[7] = 1000;  // padding row
  wide[8] = -1;
  wide[9] = int64_t{1} << 40;  // beyond int32
  DevBuf<int64_t> targets64(batch->N);
  targets64.FromHost(wide);
  DevBuf<float> lp(batch->N), lse(batch->N);
  DevBuf<uint8_t> ws(k->WorkspaceBytes(batch->N));
  CUDA_CHECK_THROW(cudaMemset(lp.ptr, 0, batch->N * 4));  // not NaN
  LinearLogpBatchView view;
  view.hidden = batch->hidden.ptr;
  view.targets64 = targets64.ptr;
  view.temperature = 0.7f;
  view.logprobs = lp.ptr;
  view.lse = lse.ptr;
  view.rows = batch->N;
  const absl::Status s = k->Launch(view, ws.ptr, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<float> got = lp.ToHost(), got_lse = lse.ToHost();
  for (int64_t i = 0; i < batch->N; ++i) {
    EXPECT_TRUE(SameBits(got_lse[i], want.lse[i])) << "row " << i;
    if (i >= 7 && i <= 9) {
      EXPECT_TRUE(std::isnan(got[i])) << "row " << i;
    } else {
      EXPECT_TRUE(SameBits(got[i], want.logprobs[i])) << "row " << i;
    }
  }
  view.temperature = 0.0f;  // a scalar temperature is checked on the host
  EXPECT_FALSE(k->Launch(view, ws.ptr, nullptr).ok());
}

}  // namespace detlogp::kernels::cuda

#endif  // DETLOGP_TESTS_CUDA_LINEAR_LOGP_TEST_SUPPORT_CUH_
