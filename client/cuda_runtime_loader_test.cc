// CudaRuntime::Load on machines without the CUDA runtime: every library
// tried is named, and one that lacks the runtime's functions is refused.
#include "client/cuda_runtime_loader.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace detlogp::client {
namespace {

TEST(CudaRuntimeLoadTest, NamesEveryLibraryTriedWhenNoneLoads) {
  CudaRuntime::Options options;
  options.libraries = {"libdetlogp_no_such_cudart.so.13",
                       "libdetlogp_no_such_cudart.so"};
  auto loaded = CudaRuntime::Load(options);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(loaded.status().message(),
                               "no CUDA runtime could be loaded ("))
      << loaded.status();
  for (const std::string& library : options.libraries) {
    EXPECT_TRUE(absl::StrContains(loaded.status().message(), library))
        << loaded.status();
  }
}

TEST(CudaRuntimeLoadTest, ALibraryWithoutTheRuntimesFunctionsIsRefused) {
  CudaRuntime::Options options;
  options.libraries = {"libc.so.6"};
  auto loaded = CudaRuntime::Load(options);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(
      absl::StrContains(loaded.status().message(), "libc.so.6: no cudaMalloc"))
      << loaded.status();
}

TEST(CudaRuntimeLoadTest, NoLibrariesLoadNothing) {
  CudaRuntime::Options options;
  options.libraries.clear();
  auto loaded = CudaRuntime::Load(options);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(loaded.status().message(), "no library named"))
      << loaded.status();
}

}  // namespace
}  // namespace detlogp::client
