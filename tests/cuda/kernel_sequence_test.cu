// KernelSequence (server/backends/cuda_kernel_sequence.h): a kernel launched
// through it on one stream waits for the kernel launched before it on
// another. A spinning kernel sets a flag at its end; a kernel on a second
// stream reads it. Launched plainly, the two run side by side and the
// reader sees 0 (the control: the streams really are concurrent); through
// the sequence it sees 1; after Forget, the next launch no longer waits.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "server/backends/cuda_kernel_sequence.h"

namespace detlogp::server {
namespace {

// About 50 ms at the clocks of a Hopper GPU.
constexpr long long kSpinCycles = 80'000'000;

__global__ void SpinThenSet(int* flag, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  __threadfence_system();
  *flag = 1;
}

__global__ void ReadFlag(const volatile int* flag, int* seen) { *seen = *flag; }

absl::Status LastLaunch() {
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? absl::OkStatus()
                              : absl::InternalError(cudaGetErrorString(error));
}

class KernelSequenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no CUDA device";
    }
    ASSERT_EQ(cudaMalloc(&flag_, sizeof(int)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&seen_, sizeof(int)), cudaSuccess);
    // Both kernels loaded before the test: under lazy module loading, the
    // first launch of a kernel waits for the device to go idle, which
    // would serialize the plain launches.
    SpinThenSet<<<1, 1>>>(flag_, 0);
    ReadFlag<<<1, 1>>>(flag_, seen_);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemset(flag_, 0, sizeof(int)), cudaSuccess);
    ASSERT_EQ(cudaMemset(seen_, 0xff, sizeof(int)), cudaSuccess);
    for (int i = 0; i < 2; ++i) {
      ASSERT_EQ(cudaStreamCreateWithFlags(&streams_[i], cudaStreamNonBlocking),
                cudaSuccess);
      ASSERT_EQ(cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming),
                cudaSuccess);
    }
  }
  void TearDown() override {
    cudaDeviceSynchronize();
    for (int i = 0; i < 2; ++i) {
      if (events_[i] != nullptr) cudaEventDestroy(events_[i]);
      if (streams_[i] != nullptr) cudaStreamDestroy(streams_[i]);
    }
    cudaFree(flag_);
    cudaFree(seen_);
  }
  int Seen() {
    int seen = -1;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(&seen, seen_, sizeof(int), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return seen;
  }
  absl::Status Spin(KernelSequence* sequence) {
    return LaunchOn(0, sequence, [&] {
      SpinThenSet<<<1, 1, 0, streams_[0]>>>(flag_, kSpinCycles);
    });
  }
  absl::Status Read(KernelSequence* sequence) {
    return LaunchOn(1, sequence,
                    [&] { ReadFlag<<<1, 1, 0, streams_[1]>>>(flag_, seen_); });
  }
  // `enqueue` on stream `i`: plainly, or through `sequence` (with event i).
  template <typename Enqueue>
  absl::Status LaunchOn(int i, KernelSequence* sequence, Enqueue enqueue) {
    auto launch = [&] {
      enqueue();
      return LastLaunch();
    };
    if (sequence == nullptr) return launch();
    return sequence->Launch(streams_[i], events_[i], launch);
  }

  int* flag_ = nullptr;
  int* seen_ = nullptr;
  cudaStream_t streams_[2] = {nullptr, nullptr};
  cudaEvent_t events_[2] = {nullptr, nullptr};
};

TEST_F(KernelSequenceTest, PlainLaunchesOnTwoStreamsRunSideBySide) {
  ASSERT_TRUE(Spin(nullptr).ok());
  ASSERT_TRUE(Read(nullptr).ok());
  EXPECT_EQ(Seen(), 0);
}

TEST_F(KernelSequenceTest, ALaunchWaitsForTheKernelLaunchedBefore) {
  KernelSequence sequence;
  ASSERT_TRUE(Spin(&sequence).ok());
  ASSERT_TRUE(Read(&sequence).ok());
  EXPECT_EQ(Seen(), 1);
}

TEST_F(KernelSequenceTest, AForgottenEventIsNotWaitedFor) {
  KernelSequence sequence;
  ASSERT_TRUE(Spin(&sequence).ok());
  sequence.Forget(events_[0]);
  ASSERT_TRUE(Read(&sequence).ok());
  EXPECT_EQ(Seen(), 0);
}

TEST_F(KernelSequenceTest, AFailedLaunchRecordsNothing) {
  KernelSequence sequence;
  ASSERT_TRUE(Spin(&sequence).ok());
  const absl::Status failed = sequence.Launch(
      streams_[1], events_[1], [] { return absl::InternalError("refused"); });
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  // The spinning kernel is still the one to wait for.
  ASSERT_TRUE(Read(&sequence).ok());
  EXPECT_EQ(Seen(), 1);
}

}  // namespace
}  // namespace detlogp::server
