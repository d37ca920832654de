// The fused backward's first device check (docs/kernels.md, "Fused
// backward"): wgmma with MN-major shared-memory operands (the tnspA / tnspB
// bits), which the fused backward's dhidden = G·W and dweight = Gᵀ·hidden GEMMs
// need to read W, G and hidden in their stored layouts. One warpgroup
// multiplies a 64 x 64 by a 64 x 128 bf16 tile (four m64n128k16 steps) with
// each operand either K-major or MN-major under the 128-byte swizzle, against a
// host reference.
//
// The descriptor of an MN-major operand has two strides: between the
// 8-row core groups along K and between the 64-element blocks along MN.
// Both assignments are tried and the test names the one that matches
// (exactly one must): on the H200 the core-group stride goes in SBO, which
// the backward's kMnMajorCoreGroupsInSbo relies on.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/cuda/hopper_ptx.cuh"

namespace detlogp::kernels::cuda {
namespace {

constexpr int kM = 64;
constexpr int kN = 128;
constexpr int kK = 64;
constexpr int kATileBytes = kM * kK * 2;  // 8 KiB
constexpr int kBTileBytes = kN * kK * 2;  // 16 KiB

// Byte offset of 16-bit element `col` of 128-byte row `row` in a tile stored
// with the 128-byte swizzle (16-byte chunk c of row r lands at c ^ (r % 8)).
__host__ __device__ inline int Sw128Offset(int row, int col) {
  const int chunk = col / 8;
  return row * 128 + ((chunk ^ (row & 7)) * 16) + (col % 8) * 2;
}

// K-major operand of `rows` rows (M or N) by kK: row r is one 128-byte row.
__host__ __device__ inline int KMajorOffset(int rc, int k) {
  return Sw128Offset(rc, k);
}

// MN-major operand: 64-element MN blocks 8 KiB apart; inside a block row k
// holds 64 MN-consecutive elements.
__host__ __device__ inline int MnMajorOffset(int rc, int k) {
  return (rc / 64) * (kK * 128) + Sw128Offset(k, rc % 64);
}

// Descriptor with explicit leading/stride byte offsets (128-byte swizzle).
__device__ inline uint64_t Desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFFu) >> 4);
  d |= static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16;
  d |= static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

// D[64 x 128] (+)= op(A) · op(B)ᵀ with the transpose bits as immediates.
template <int kTransA, int kTransB>
__device__ inline void WgmmaM64N128K16T(float* d, uint64_t da, uint64_t db,
                                        int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
      "%30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "
      "%58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]),
        "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
        "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]),
        "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),
        "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// Descriptor offsets of the MN-major operand(s): (leading, stride).
struct Layout {
  uint32_t mn_lbo;
  uint32_t mn_sbo;
};

// a: [kM][kK] and b: [kN][kK] row-major bf16 bits in global memory; out:
// [kM][kN] fp32. One warpgroup.
template <int kTransA, int kTransB>
__global__ void MultiplyTile(const uint16_t* a, const uint16_t* b, Layout l,
                             float* out) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* sa = smem;
  uint8_t* sb = smem + kATileBytes;
  for (int i = threadIdx.x; i < kM * kK; i += blockDim.x) {
    const int m = i / kK, k = i % kK;
    const int off = kTransA ? MnMajorOffset(m, k) : KMajorOffset(m, k);
    *reinterpret_cast<uint16_t*>(sa + off) = a[i];
  }
  for (int i = threadIdx.x; i < kN * kK; i += blockDim.x) {
    const int n = i / kK, k = i % kK;
    const int off = kTransB ? MnMajorOffset(n, k) : KMajorOffset(n, k);
    *reinterpret_cast<uint16_t*>(sb + off) = b[i];
  }
  ptx::FenceProxyAsyncShared();  // generic-proxy stores -> wgmma reads
  __syncthreads();

  float acc[kN / 2];
  for (float& v : acc) v = 0.0f;
  const uint32_t a_addr = ptx::SmemAddr(sa);
  const uint32_t b_addr = ptx::SmemAddr(sb);
  ptx::WgmmaFence();
#pragma unroll
  for (int k = 0; k < kK / 16; ++k) {
    // K-major: +32 bytes per 16 k inside the swizzled row (LBO unused,
    // SBO = 8 rows x 128 B). MN-major: +16 rows of 128 B per 16 k.
    const uint64_t da = kTransA ? Desc(a_addr + k * 2048, l.mn_lbo, l.mn_sbo)
                                : Desc(a_addr + k * 32, 16, 1024);
    const uint64_t db = kTransB ? Desc(b_addr + k * 2048, l.mn_lbo, l.mn_sbo)
                                : Desc(b_addr + k * 32, 16, 1024);
    WgmmaM64N128K16T<kTransA, kTransB>(acc, da, db, 1);
  }
  ptx::WgmmaCommit();
  ptx::WgmmaWait<0>();
  ptx::FenceAccumulators<kN / 2>(acc);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = 0; j < kN / 8; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + lane / 4 + 8 * (e / 2);
      const int col = 8 * j + 2 * (lane % 4) + (e % 2);
      out[row * kN + col] = acc[4 * j + e];
    }
  }
}

void CheckCuda(cudaError_t e, const char* what) {
  ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e);
}

class WgmmaMnMajorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int device = 0;
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess ||
        prop.major != 9) {
      GTEST_SKIP() << "needs an sm_90 GPU";
    }
    std::mt19937 rng(15);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    a_.resize(kM * kK);
    b_.resize(kN * kK);
    for (auto& v : a_) v = FloatToBf16(u(rng));
    for (auto& v : b_) v = FloatToBf16(u(rng));
    reference_.assign(kM * kN, 0.0);
    for (int m = 0; m < kM; ++m) {
      for (int n = 0; n < kN; ++n) {
        double s = 0.0;
        for (int k = 0; k < kK; ++k) {
          s += static_cast<double>(Bf16ToFloat(a_[m * kK + k])) *
               Bf16ToFloat(b_[n * kK + k]);
        }
        reference_[m * kN + n] = s;
      }
    }
  }

 public:
  // Runs one layout; returns the largest error against the reference.
  template <int kTransA, int kTransB>
  double Run(const Layout& l, std::vector<float>* result) {
    uint16_t *da = nullptr, *db = nullptr;
    float* dout = nullptr;
    CheckCuda(cudaMalloc(&da, a_.size() * 2), "malloc a");
    CheckCuda(cudaMalloc(&db, b_.size() * 2), "malloc b");
    CheckCuda(cudaMalloc(&dout, kM * kN * 4), "malloc out");
    cudaMemcpy(da, a_.data(), a_.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b_.data(), b_.size() * 2, cudaMemcpyHostToDevice);
    cudaMemset(dout, 0xff, kM * kN * 4);  // NaN where nothing was written
    const int smem = kATileBytes + kBTileBytes + 1024;
    cudaFuncSetAttribute(MultiplyTile<kTransA, kTransB>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    MultiplyTile<kTransA, kTransB><<<1, 128, smem>>>(da, db, l, dout);
    CheckCuda(cudaDeviceSynchronize(), "MultiplyTile");
    result->resize(kM * kN);
    cudaMemcpy(result->data(), dout, kM * kN * 4, cudaMemcpyDeviceToHost);
    cudaFree(da);
    cudaFree(db);
    cudaFree(dout);
    double worst = 0.0;
    for (int i = 0; i < kM * kN; ++i) {
      const double err = std::fabs((*result)[i] - reference_[i]);
      worst = std::isnan(err) ? INFINITY : std::max(worst, err);
    }
    return worst;
  }

 private:
  std::vector<uint16_t> a_, b_;
  std::vector<double> reference_;
};

// |error| of a 64-term bf16 dot product in fp32: far below this.
constexpr double kTolerance = 1e-3;

// The two assignments of an MN-major operand's strides: 8-row core groups
// along K are 1024 bytes apart, 64-element MN blocks 8 KiB apart.
constexpr Layout kGroupsInSbo{kK * 128, 1024};
constexpr Layout kGroupsInLbo{1024, kK * 128};

TEST_F(WgmmaMnMajorTest, KMajorBothMatchesReference) {
  std::vector<float> out;
  EXPECT_LT((Run<0, 0>(kGroupsInSbo, &out)), kTolerance);
}

// Runs the MN-major operand(s) with both stride assignments: exactly one
// must match the reference, and its bits must equal the K-major run's: the
// same products accumulated in the same order, whichever way the operand
// lies in shared memory (the fused backward relies on it).
template <int kTransA, int kTransB>
void ExpectOneAssignmentMatches(WgmmaMnMajorTest* test, const char* operand) {
  std::vector<float> k_major, sbo, lbo;
  test->Run<0, 0>(kGroupsInSbo, &k_major);
  const double err_sbo = test->Run<kTransA, kTransB>(kGroupsInSbo, &sbo);
  const double err_lbo = test->Run<kTransA, kTransB>(kGroupsInLbo, &lbo);
  std::printf("MN-major %s: core groups in SBO -> max err %g; in LBO -> %g\n",
              operand, err_sbo, err_lbo);
  EXPECT_TRUE((err_sbo < kTolerance) != (err_lbo < kTolerance))
      << "exactly one stride assignment must match";
  EXPECT_EQ(ptx::kMnMajorCoreGroupsInSbo, err_sbo < kTolerance)
      << "hopper_ptx.cuh's MakeSmemDescSw128MnMajor must use the assignment "
         "that matched";
  const std::vector<float>& good = err_sbo < kTolerance ? sbo : lbo;
  ASSERT_EQ(good.size(), k_major.size());
  EXPECT_EQ(std::memcmp(good.data(), k_major.data(), good.size() * 4), 0)
      << "MN-major " << operand << ": bits differ from the K-major run's";
}

TEST_F(WgmmaMnMajorTest, MnMajorBMatchesReference) {
  ExpectOneAssignmentMatches<0, 1>(this, "B");
}

TEST_F(WgmmaMnMajorTest, MnMajorAMatchesReference) {
  ExpectOneAssignmentMatches<1, 0>(this, "A");
}

}  // namespace
}  // namespace detlogp::kernels::cuda
