// What the tests of single device pieces (top_k_screens_test,
// top_k_floor_test) share: a fixture that skips without an sm_90 GPU, and
// copies between host vectors and device buffers.
#ifndef DETLOGP_TESTS_CUDA_DEVICE_PIECE_TEST_CUH_
#define DETLOGP_TESTS_CUDA_DEVICE_PIECE_TEST_CUH_

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

namespace detlogp::cuda_test {

// These binaries hold sm_90a code (the CPU machines that build them skip
// them).
class Sm90Test : public ::testing::Test {
 protected:
  void SetUp() override {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "needs an sm_90 GPU";
    }
  }
};

// A device copy of `host`; the caller frees it.
template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  return device;
}

template <typename T>
std::vector<T> ToHost(const T* device, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(
      cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost),
      cudaSuccess);
  return host;
}

}  // namespace detlogp::cuda_test

#endif  // DETLOGP_TESTS_CUDA_DEVICE_PIECE_TEST_CUH_
