// The CUDA projection backend against the CPU backend, through the
// executors the server uses: chunk buffers from the CUDA backend's pinned
// pool take Y straight from the device, a pageable (heap) destination goes
// through staging, and every piece has the CPU backend's bits (memcmp).
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/projection.h"
#include "server/backends/projection_backend.h"
#include "server/models/projection_weights.h"

namespace detlogp::server {
namespace {

using kernels::kProjectionInDim;
using kernels::kProjectionOutDim;
constexpr size_t kRowBytes = kProjectionOutDim * sizeof(float);

TEST(ProjectionBackendCudaTest, ChunksGetTheCpuBackendsBitsDirectOrStaged) {
  const ProjectionWeights weights = SyntheticProjectionWeights();
  ProjectionBackendOptions options;
  options.weights = &weights;
  auto cuda = CreateCudaProjectionBackend(options);
  if (absl::IsUnavailable(cuda.status())) GTEST_SKIP() << cuda.status();
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  auto cpu = CreateCpuProjectionBackend(options);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  constexpr int64_t kCapacity = 2048;
  auto gpu_executor = (*cuda)->NewExecutor(kCapacity);
  auto cpu_executor = (*cpu)->NewExecutor(kCapacity);
  ASSERT_TRUE(gpu_executor.ok()) << gpu_executor.status();
  ASSERT_TRUE(cpu_executor.ok()) << cpu_executor.status();

  // Pieces of one launch: pinned from the pool, and one from the heap.
  std::shared_ptr<HostBufferPool> pool = (*cuda)->host_buffer_pool();
  const std::vector<int64_t> rows = {7, 100, 512, 1, 1300};
  const std::vector<bool> pinned = {true, false, true, true, true};
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  ASSERT_LE(total, kCapacity);
  std::vector<HostBuffer> gpu_out, cpu_out;
  std::vector<YDestination> gpu_pieces, cpu_pieces;
  for (size_t i = 0; i < rows.size(); ++i) {
    gpu_out.push_back(pinned[i] ? pool->Acquire(rows[i] * kRowBytes)
                                : HeapHostBuffer(rows[i] * kRowBytes));
    cpu_out.push_back(HeapHostBuffer(rows[i] * kRowBytes));
    std::memset(gpu_out[i].data(), 0xff, gpu_out[i].bytes());  // NaNs
    gpu_pieces.push_back(
        {reinterpret_cast<float*>(gpu_out[i].data()), rows[i]});
    cpu_pieces.push_back(
        {reinterpret_cast<float*>(cpu_out[i].data()), rows[i]});
  }

  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const ProjectionStaging gpu_x = (*gpu_executor)->staging();
  const ProjectionStaging cpu_x = (*cpu_executor)->staging();
  for (int64_t i = 0; i < total * kProjectionInDim; ++i) {
    gpu_x.x[i] = cpu_x.x[i] = normal(rng);
  }
  ProjectionRunStats gpu_stats, cpu_stats;
  ASSERT_TRUE((*gpu_executor)->Run(total, gpu_pieces, &gpu_stats).ok());
  ASSERT_TRUE((*cpu_executor)->Run(total, cpu_pieces, &cpu_stats).ok());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(
        std::memcmp(gpu_out[i].data(), cpu_out[i].data(), rows[i] * kRowBytes),
        0)
        << "piece " << i << (pinned[i] ? " (pinned)" : " (heap)");
  }
  // Only the heap piece was copied on the host.
  EXPECT_GT(gpu_stats.copy_out_seconds, 0.0);

  // All pinned: nothing copied on the host.
  std::vector<YDestination> direct = {gpu_pieces[0], gpu_pieces[2]};
  ProjectionRunStats direct_stats;
  ASSERT_TRUE(
      (*gpu_executor)->Run(rows[0] + rows[2], direct, &direct_stats).ok());
  EXPECT_EQ(direct_stats.copy_out_seconds, 0.0);

  // Pieces that do not add up to the launch are refused.
  EXPECT_EQ((*gpu_executor)->Run(total + 1, gpu_pieces, nullptr).code(),
            absl::StatusCode::kInternal);

  // The buffers outlive the backend (gRPC may hold a chunk that long):
  // still writable, then back to the pool, which the last of them frees.
  gpu_executor->reset();
  cuda->reset();
  pool.reset();
  for (HostBuffer& buffer : gpu_out)
    std::memset(buffer.data(), 0, buffer.bytes());
  gpu_out.clear();
}

}  // namespace
}  // namespace detlogp::server
