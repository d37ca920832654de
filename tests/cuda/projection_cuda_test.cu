// GPU tests of the H3 video input projection: CPU == GPU bits (memcmp) for
// every forward variant and for dX, accuracy against float64, poisoned
// outputs fully written, batch invariance on the device, and error handling.
// Fresh random data per test (seeded from the clock, printed on failure).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/projection_cuda.h"
#include "kernels/projection.h"
#include "kernels/projection_grad.h"

namespace detlogp::kernels {
namespace {

constexpr int64_t kK = kProjectionInDim;
constexpr int64_t kN = kProjectionOutDim;
using Variant = ProjectionCuda::ForwardVariant;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

uint64_t FreshSeed() {
  return static_cast<uint64_t>(
      std::chrono::high_resolution_clock::now().time_since_epoch().count());
}

std::vector<float> RandomVector(int64_t n, float scale, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

// A device buffer that frees itself.
struct DeviceBuffer {
  float* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(n) {
    if (cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(float)) !=
        cudaSuccess) {
      ptr = nullptr;
    }
  }
  DeviceBuffer(const std::vector<float>& host) : DeviceBuffer(host.size()) {
    if (ptr != nullptr) {
      cudaMemcpy(ptr, host.data(), host.size() * sizeof(float),
                 cudaMemcpyHostToDevice);
    }
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void Poison() { cudaMemset(ptr, 0xFF, count * sizeof(float)); }  // NaNs
  std::vector<float> ToHost() const {
    std::vector<float> h(count);
    cudaMemcpy(h.data(), ptr, count * sizeof(float), cudaMemcpyDeviceToHost);
    return h;
  }
};

struct Fixture {
  uint64_t seed = FreshSeed();
  std::mt19937_64 rng{seed};
  std::vector<float> weight = RandomVector(kN * kK, 1.f / std::sqrt(96.f), rng);
  std::vector<float> bias = RandomVector(kN, 0.5f, rng);
  DeviceBuffer d_weight{weight};
  DeviceBuffer d_bias{bias};

  std::unique_ptr<ProjectionCuda> Gpu(Variant v, bool with_bias) {
    ProjectionCuda::Options o;
    o.weight = d_weight.ptr;
    o.bias = with_bias ? d_bias.ptr : nullptr;
    o.variant = v;
    auto p = ProjectionCuda::Create(o);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }
  std::vector<float> Cpu(const std::vector<float>& x, bool with_bias) {
    ProjectionCpu::Options o;
    o.weight = weight;
    if (with_bias) o.bias = bias;
    auto cpu = ProjectionCpu::Create(o);
    EXPECT_TRUE(cpu.ok());
    const int64_t rows = static_cast<int64_t>(x.size()) / kK;
    std::vector<float> y(rows * kN);
    EXPECT_TRUE((*cpu)->Forward(x, rows, absl::MakeSpan(y)).ok());
    return y;
  }
};

std::vector<float> GpuForward(const ProjectionCuda& gpu,
                              const std::vector<float>& x,
                              cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(x.size()) / kK;
  DeviceBuffer dx(x), dy(rows * kN);
  dy.Poison();
  EXPECT_TRUE(gpu.Forward(dx.ptr, rows, dy.ptr, stream).ok());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  return dy.ToHost();
}

TEST(ProjectionCudaTest, ForwardBitsEqualCpuForEveryVariant) {
  Fixture f;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  for (Variant v : {Variant::kSingleStage, Variant::kDoubleBuffered,
                    Variant::kSplitLoad, Variant::kWide, Variant::kDefault}) {
    for (bool with_bias : {true, false}) {
      auto gpu = f.Gpu(v, with_bias);
      ASSERT_NE(gpu, nullptr);
      std::vector<int64_t> row_counts = {1, 5, 127, 128, 129, 1000, 2901};
      if (v == Variant::kDefault) row_counts.push_back(8229);  // picks kWide
      for (int64_t rows : row_counts) {
        std::vector<float> x = RandomVector(rows * kK, 1.5f, f.rng);
        std::vector<float> y = GpuForward(*gpu, x, stream);
        std::vector<float> ref = f.Cpu(x, with_bias);
        EXPECT_EQ(0, std::memcmp(y.data(), ref.data(), y.size() * 4))
            << gpu->VariantName() << " bias=" << with_bias << " rows=" << rows
            << " seed=" << f.seed;
      }
    }
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(ProjectionCudaTest, ForwardMatchesFloat64) {
  Fixture f;
  auto gpu = f.Gpu(Variant::kDefault, true);
  const int64_t rows = 300;
  std::vector<float> x = RandomVector(rows * kK, 1.f, f.rng);
  std::vector<float> y = GpuForward(*gpu, x, nullptr);
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < kN; ++o) {
      double d = f.bias[o];
      for (int64_t k = 0; k < kK; ++k) {
        d += static_cast<double>(x[r * kK + k]) * f.weight[o * kK + k];
      }
      const double err = std::fabs(y[r * kN + o] - d);
      bad += !(err <= 1e-4 + 1e-4 * std::fabs(d));
    }
  }
  EXPECT_EQ(bad, 0) << "seed=" << f.seed;
}

TEST(ProjectionCudaTest, RowBitsIgnorePermutationMicroBatchingPadding) {
  Fixture f;
  auto gpu = f.Gpu(Variant::kDefault, true);
  const int64_t rows = 777;
  std::vector<float> x = RandomVector(rows * kK, 1.f, f.rng);
  const std::vector<float> y = GpuForward(*gpu, x, nullptr);

  std::vector<int64_t> perm(rows);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), f.rng);
  std::vector<float> xp(rows * kK);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(x.begin() + perm[r] * kK, kK, xp.begin() + r * kK);
  }
  const std::vector<float> yp = GpuForward(*gpu, xp, nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    ASSERT_EQ(0, std::memcmp(&yp[r * kN], &y[perm[r] * kN], kN * 4)) << r;
  }
  // Micro-batches launched on sub-ranges of one device buffer.
  DeviceBuffer dx(x), dy(rows * kN);
  dy.Poison();
  for (int64_t begin = 0, step = 1; begin < rows; begin += step, step *= 3) {
    const int64_t n = std::min(rows - begin, step);
    ASSERT_TRUE(
        gpu->Forward(dx.ptr + begin * kK, n, dy.ptr + begin * kN, nullptr)
            .ok());
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> ym = dy.ToHost();
  EXPECT_EQ(0, std::memcmp(ym.data(), y.data(), y.size() * 4));
  // Padding: garbage rows around the batch.
  std::vector<float> padded = RandomVector(3 * kK, 1e3f, f.rng);
  padded.insert(padded.end(), x.begin(), x.end());
  std::vector<float> tail = RandomVector(200 * kK, 1e5f, f.rng);
  padded.insert(padded.end(), tail.begin(), tail.end());
  std::vector<float> ypad = GpuForward(*gpu, padded, nullptr);
  EXPECT_EQ(0, std::memcmp(&ypad[3 * kN], y.data(), y.size() * 4));
}

TEST(ProjectionCudaTest, InputGradBitsEqualCpuAndMatchFloat64) {
  Fixture f;
  auto gpu = f.Gpu(Variant::kDefault, true);
  for (int64_t rows : {1, 3, 130, 256, 257, 1000, 5000}) {
    std::vector<float> dy = RandomVector(rows * kN, 1.f, f.rng);
    std::vector<float> ref(rows * kK);
    ASSERT_TRUE(
        ProjectionInputGrad(f.weight, dy, rows, absl::MakeSpan(ref)).ok());
    DeviceBuffer d_dy(dy), d_dx(rows * kK);
    // Row-serial (<= 256 rows), chunk-split (workspace) and one-pass paths:
    // same bits.
    const int64_t ws_bytes = ProjectionCuda::InputGradWorkspaceBytes(rows);
    EXPECT_EQ(ws_bytes, rows <= 256 ? 0 : 42 * rows * kK * 4);
    DeviceBuffer ws(std::max<int64_t>(ws_bytes / 4, 4));
    ws.Poison();
    d_dx.Poison();
    ASSERT_TRUE(
        gpu->InputGrad(d_dy.ptr, rows, d_dx.ptr, ws.ptr, ws_bytes, nullptr)
            .ok());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> dx_split = d_dx.ToHost();
    EXPECT_EQ(0, std::memcmp(dx_split.data(), ref.data(), dx_split.size() * 4))
        << "split rows=" << rows << " seed=" << f.seed;
    d_dx.Poison();
    ASSERT_TRUE(gpu->InputGrad(d_dy.ptr, rows, d_dx.ptr, nullptr).ok());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> dx = d_dx.ToHost();
    EXPECT_EQ(0, std::memcmp(dx.data(), ref.data(), dx.size() * 4))
        << "rows=" << rows << " seed=" << f.seed;
    if (rows == 1000) {  // too-small workspace: an error, not a wrong result
      EXPECT_FALSE(gpu->InputGrad(d_dy.ptr, rows, d_dx.ptr, ws.ptr,
                                  ws_bytes - 16, nullptr)
                       .ok());
    }
    if (rows == 3) {
      int64_t bad = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < kK; ++k) {
          double d = 0;
          for (int64_t o = 0; o < kN; ++o) {
            d += static_cast<double>(dy[r * kN + o]) * f.weight[o * kK + k];
          }
          bad += !(std::fabs(dx[r * kK + k] - d) <= 1e-4 + 1e-4 * std::fabs(d));
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(ProjectionCudaTest, WeightGradBitsEqualCpuForKeyedRows) {
  Fixture f;
  auto gpu = f.Gpu(Variant::kDefault, true);
  // (rows, first_key): chunk and superchunk (4096 keys) edges both ways.
  const std::vector<std::pair<int64_t, int64_t>> cases = {
      {1, 0},
      {1, 4095},
      {64, 64},
      {130, 77},
      {300, 4000},
      {5000, 1234},
      {4096, 8192},
      // >= 4 superchunks: the one-k-part kernel and the separate dbias pass.
      {12300, 4000}};
  for (auto [rows, first_key] : cases) {
    std::vector<float> dy = RandomVector(rows * kN, 1.f, f.rng);
    std::vector<float> x = RandomVector(rows * kK, 1.f, f.rng);
    std::vector<int64_t> keys(rows);
    std::iota(keys.begin(), keys.end(), first_key);
    auto ref = ComputeProjectionWeightGrads(dy, x, keys);
    ASSERT_TRUE(ref.ok());
    DeviceBuffer d_dy(dy), d_x(x), d_dw(kN * kK), d_db(kN);
    const int64_t ws_bytes =
        ProjectionCuda::WeightGradWorkspaceBytes(rows, first_key);
    DeviceBuffer ws(ws_bytes / 4);
    ws.Poison();
    d_dw.Poison();
    d_db.Poison();
    ASSERT_TRUE(gpu->WeightGrad(d_dy.ptr, d_x.ptr, rows, first_key, d_dw.ptr,
                                d_db.ptr, ws.ptr, ws_bytes, nullptr)
                    .ok());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> dw = d_dw.ToHost(), db = d_db.ToHost();
    EXPECT_EQ(0, std::memcmp(dw.data(), ref->dweight.data(), dw.size() * 4))
        << "rows=" << rows << " first_key=" << first_key << " seed=" << f.seed;
    EXPECT_EQ(0, std::memcmp(db.data(), ref->dbias.data(), db.size() * 4))
        << "rows=" << rows << " first_key=" << first_key << " seed=" << f.seed;
  }
  DeviceBuffer small(16), dw(kN * kK);
  // Keys 4095, 4096 span two superchunks: a 64-byte workspace is too small.
  EXPECT_GT(ProjectionCuda::WeightGradWorkspaceBytes(2, 4095), 64);
  EXPECT_EQ(ProjectionCuda::WeightGradWorkspaceBytes(4096, 0), 0);
  EXPECT_FALSE(gpu->WeightGrad(small.ptr, small.ptr, 2, 4095, dw.ptr, nullptr,
                               small.ptr, 64, nullptr)
                   .ok());
  EXPECT_FALSE(gpu->WeightGrad(small.ptr, small.ptr, 1, -3, dw.ptr, nullptr,
                               small.ptr, 64, nullptr)
                   .ok());
  EXPECT_TRUE(gpu->WeightGrad(nullptr, nullptr, 0, 0, dw.ptr, nullptr, nullptr,
                              0, nullptr)
                  .ok());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> zeros = dw.ToHost();
  EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](float v) {
    return v == 0.f && !std::signbit(v);
  }));
}

TEST(ProjectionCudaTest, BadArgumentsAreErrors) {
  Fixture f;
  ProjectionCuda::Options o;
  EXPECT_EQ(ProjectionCuda::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.weight = f.d_weight.ptr;
  o.device = 1000;
  EXPECT_EQ(ProjectionCuda::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto gpu = f.Gpu(Variant::kDefault, true);
  DeviceBuffer x(4 * kK), y(4 * kN);
  EXPECT_FALSE(gpu->Forward(x.ptr, -1, y.ptr, nullptr).ok());
  EXPECT_FALSE(gpu->Forward(nullptr, 4, y.ptr, nullptr).ok());
  EXPECT_FALSE(gpu->Forward(x.ptr + 1, 3, y.ptr, nullptr).ok());  // unaligned
  EXPECT_TRUE(gpu->Forward(nullptr, 0, nullptr, nullptr).ok());
  EXPECT_FALSE(gpu->InputGrad(y.ptr, 4, nullptr, nullptr).ok());
  EXPECT_FALSE(gpu->InputGrad(y.ptr, -2, x.ptr, nullptr).ok());
  EXPECT_EQ(ProjectionCuda::InputGradWorkspaceBytes(8193), 0);
  EXPECT_EQ(ProjectionCuda::InputGradWorkspaceBytes(0), 0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace detlogp::kernels
