// The ProjectionService end to end over loopback: streamed chunks reassemble
// to the CPU kernel's bits; bad input; a cancelled stream; a slow reader that
// must not make the server buffer the whole video; in process, a slow
// reader's stream holds no more chunk buffers than its budget.
#include <grpcpp/client_context.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/logp_client.h"
#include "kernels/projection.h"
#include "server/backends/caching_host_buffer_pool.h"
#include "server/backends/projection_backend.h"
#include "server/batching/projection_scheduler.h"
#include "server/models/projection_weights.h"
#include "server/transport/projection_service.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using testing::ServerProcess;

std::vector<float> RandomX(int64_t rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * kernels::kProjectionInDim);
  for (float& v : x) v = normal(rng);
  return x;
}

int64_t ResidentKiB(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

class ProjectionServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start({"--device=cpu", "--cpu_threads=2"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(SIGTERM), 0) << server_->Log();
    delete server_;
  }
  std::unique_ptr<LogpClient> Connect() {
    LogpClient::Options options;
    options.target = server_->target();
    options.max_message_bytes = 256 << 20;
    return *LogpClient::Create(options);
  }
  static ServerProcess* server_;
};
ServerProcess* ProjectionServiceTest::server_ = nullptr;

TEST_F(ProjectionServiceTest, StreamedChunksReassembleToTheCpuKernelsBits) {
  const server::ProjectionWeights weights =
      server::SyntheticProjectionWeights();
  kernels::ProjectionCpu::Options options;
  options.weight = weights.weight;
  options.bias = weights.bias;
  auto cpu = *kernels::ProjectionCpu::Create(options);
  auto client = Connect();
  const int64_t rows = 1000;
  const std::vector<float> x = RandomX(rows, 5);
  std::vector<float> expected(rows * kernels::kProjectionOutDim);
  ASSERT_TRUE(cpu->Forward(x, rows, absl::MakeSpan(expected)).ok());
  std::string key;
  for (int64_t chunk : {0, 1, 7, 128, 1000}) {
    auto result = client->Project(x, rows, chunk);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->y.size(), expected.size());
    EXPECT_EQ(std::memcmp(result->y.data(), expected.data(),
                          expected.size() * sizeof(float)),
              0)
        << "rows_per_chunk " << chunk;
    if (chunk > 0) {
      EXPECT_EQ(result->chunks, (rows + chunk - 1) / chunk);
    }
    if (key.empty()) key = result->determinism_key;
    EXPECT_EQ(result->determinism_key, key);
  }
  EXPECT_EQ(key.rfind("dk1-", 0), 0u);
  // A row's bits do not depend on what it was sent with.
  auto one = client->Project(
      std::vector<float>(x.begin() + 500 * 96, x.begin() + 501 * 96), 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(std::memcmp(one->y.data(), expected.data() + 500 * 5376, 5376 * 4),
            0);
}

TEST_F(ProjectionServiceTest,
       ConcurrentStreamsShareLaunchesWithoutChangingBits) {
  auto client = Connect();
  const std::vector<float> x = RandomX(64, 9);
  auto alone = client->Project(x, 64, 16);
  ASSERT_TRUE(alone.ok());
  std::vector<std::thread> threads;
  std::atomic<int> equal{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      auto result = client->Project(x, 64, 16);
      if (result.ok() && result->y == alone->y) ++equal;
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(equal.load(), 8);
}

TEST_F(ProjectionServiceTest, BadShapesAndDtypesAreInvalidArgument) {
  auto client = Connect();
  auto stub = client->projection_stub();
  auto project = [&](const v1::ProjectRequest& request) {
    grpc::ClientContext context;
    auto reader = stub->Project(&context, request);
    v1::ProjectResponse response;
    while (reader->Read(&response)) {
    }
    return reader->Finish();
  };
  v1::ProjectRequest good;
  good.mutable_x()->set_dtype(v1::DTYPE_FLOAT32);
  good.mutable_x()->add_shape(2);
  good.mutable_x()->add_shape(96);
  good.mutable_x()->set_data(std::string(2 * 96 * 4, '\0'));
  EXPECT_TRUE(project(good).ok());
  v1::ProjectRequest bad = good;
  bad.mutable_x()->set_dtype(v1::DTYPE_BFLOAT16);
  EXPECT_EQ(project(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = good;
  bad.mutable_x()->set_shape(1, 95);
  EXPECT_EQ(project(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = good;
  bad.mutable_x()->mutable_data()->pop_back();
  const grpc::Status short_data = project(bad);
  EXPECT_EQ(short_data.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(short_data.error_message().find("x.data"), std::string::npos);
  bad = good;
  bad.set_rows_per_chunk(-3);
  EXPECT_EQ(project(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = good;
  bad.set_rows_per_chunk(1 << 20);
  EXPECT_EQ(project(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ProjectionServiceTest, CancelledStreamLeavesTheServerServing) {
  auto client = Connect();
  const std::vector<float> x = RandomX(4000, 11);
  v1::ProjectRequest request;
  request.set_rows_per_chunk(100);
  request.mutable_x()->set_dtype(v1::DTYPE_FLOAT32);
  request.mutable_x()->add_shape(4000);
  request.mutable_x()->add_shape(96);
  request.mutable_x()->set_data(reinterpret_cast<const char*>(x.data()),
                                x.size() * 4);
  grpc::ClientContext context;
  auto reader = client->projection_stub()->Project(&context, request);
  v1::ProjectResponse response;
  ASSERT_TRUE(reader->Read(&response));
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(client->Project(RandomX(3, 12), 3).ok());
}

// One stream's server memory: the client is held to a single call (by
// default a projection this large goes over several, each with its ring).
LogpClient::ProjectOptions OneStream(int64_t rows_per_chunk) {
  LogpClient::ProjectOptions options;
  options.rows_per_chunk = rows_per_chunk;
  options.streams = 1;
  return options;
}

TEST_F(ProjectionServiceTest, SlowReaderDoesNotMakeTheServerBufferTheVideo) {
  auto client = Connect();
  // 24,000 rows: 516 MB of output in 47 chunks of 512 rows.
  const int64_t rows = 24000;
  const std::vector<float> x = RandomX(rows, 13);
  const int64_t rss_before = ResidentKiB(server_->pid());
  int64_t rss_peak = rss_before;
  auto result = client->ProjectChunks(
      x, rows, OneStream(512), [&](client::ProjectChunk&) {
        absl::SleepFor(absl::Milliseconds(30));
        rss_peak = std::max(rss_peak, ResidentKiB(server_->pid()));
      });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->chunks, (rows + 511) / 512);
  const int64_t growth_mib = (rss_peak - rss_before) / 1024;
  std::cout << "server RSS before " << rss_before / 1024 << " MiB, peak "
            << rss_peak / 1024 << " MiB while streaming 516 MB slowly\n";
  // The stream's ring (64 MiB: five 11 MB chunks), the request (9 MB) and
  // gRPC's buffers.
  EXPECT_LT(growth_mib, 150);
}

TEST_F(ProjectionServiceTest, AFullSizeVideoStreamsInBoundedServerMemory) {
  // 364,608 rows: 140 MB of X in, 7.8 GB of Y out in 713 chunks of 512
  // rows, consumed chunk by chunk; the server holds at most its 64 MiB ring.
  auto client = Connect();
  const int64_t rows = 364608;
  const std::vector<float> x = RandomX(rows, 17);
  const int64_t rss_before = ResidentKiB(server_->pid());
  int64_t rss_peak = rss_before;
  int64_t chunks_seen = 0;
  auto result = client->ProjectChunks(
      x, rows, OneStream(512), [&](client::ProjectChunk&) {
        if (++chunks_seen % 50 == 0) {
          rss_peak = std::max(rss_peak, ResidentKiB(server_->pid()));
        }
      });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->chunks, (rows + 511) / 512);
  const int64_t growth_mib = (rss_peak - rss_before) / 1024;
  std::cout << "364,608-row video: " << result->chunks << " chunks; server RSS "
            << rss_before / 1024 << " MiB before, peak " << rss_peak / 1024
            << " MiB\n";
  // The request itself (140 MB, held once) plus the ring and gRPC's buffers.
  EXPECT_LT(growth_mib, 400);
}

// y[r][o] = x[r][0] + o: every output row says which input row it came from.
class RowTagBackend final : public server::ProjectionBackend {
 public:
  RowTagBackend() { description_.name = "row-tag"; }
  const server::BackendDescription& description() const override {
    return description_;
  }
  absl::StatusOr<std::unique_ptr<server::ProjectionExecutor>> NewExecutor(
      int64_t max_rows) override {
    return std::unique_ptr<server::ProjectionExecutor>(new Executor(max_rows));
  }

 private:
  class Executor final : public server::ProjectionExecutor {
   public:
    explicit Executor(int64_t rows) : x_(rows * kernels::kProjectionInDim) {}
    server::ProjectionStaging staging() override {
      return {static_cast<int64_t>(x_.size() / kernels::kProjectionInDim),
              x_.data()};
    }
    // Straight into the destinations, as the CUDA executor does.
    absl::Status Run(int64_t rows,
                     absl::Span<const server::YDestination> outputs,
                     server::ProjectionRunStats*) override {
      const float* x = x_.data();
      for (const server::YDestination& output : outputs) {
        for (int64_t r = 0; r < output.rows;
             ++r, x += kernels::kProjectionInDim) {
          for (int64_t o = 0; o < kernels::kProjectionOutDim; ++o) {
            output.y[r * kernels::kProjectionOutDim + o] =
                x[0] + static_cast<float>(o);
          }
        }
      }
      return absl::OkStatus();
    }

   private:
    std::vector<float> x_;
  };
  server::BackendDescription description_;
};

TEST(ProjectionServiceInProcessTest,
     ASlowReadersStreamHoldsAtMostItsBufferBudget) {
  constexpr int64_t kChunkRows = 64, kChunks = 40, kRows = kChunkRows * kChunks;
  constexpr int64_t kChunkBytes = kChunkRows * kernels::kProjectionOutDim * 4;
  RowTagBackend backend;
  server::ProjectionScheduler::Options scheduler_options;
  scheduler_options.max_launch_rows = 256;
  auto scheduler =
      server::ProjectionScheduler::Create(scheduler_options, &backend);
  ASSERT_TRUE(scheduler.ok()) << scheduler.status();
  absl::Mutex mu;
  std::vector<server::ProjectionServiceImpl::StreamTimings> streams;
  absl::Notification stream_done;
  // Chunk buffers from a recycling pool (the CUDA backend's, with malloc
  // in place of cudaHostAlloc), counted.
  std::atomic<int> allocations{0}, frees{0};
  server::CachingHostBufferPool::Options pool_options;
  pool_options.allocate = [&](size_t bytes) {
    ++allocations;
    return std::malloc(bytes);
  };
  pool_options.free = [&](void* data) {
    ++frees;
    std::free(data);
  };
  std::shared_ptr<server::CachingHostBufferPool> pool =
      *server::CachingHostBufferPool::Create(pool_options);
  server::ProjectionServiceImpl::Options options;
  options.determinism_key = "key";
  options.max_stream_buffer_bytes = 3 * kChunkBytes;
  options.chunk_buffers = pool;
  options.on_stream_timings =
      [&](const server::ProjectionServiceImpl::StreamTimings& t) {
        absl::MutexLock lock(&mu);
        streams.push_back(t);
        stream_done.Notify();
      };
  server::ProjectionServiceImpl service(options, scheduler->get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  ASSERT_NE(grpc_server, nullptr);

  const std::vector<float> x = RandomX(kRows, 21);
  v1::ProjectRequest request;
  request.set_request_id("slow");
  request.set_rows_per_chunk(kChunkRows);
  request.mutable_x()->set_dtype(v1::DTYPE_FLOAT32);
  request.mutable_x()->add_shape(kRows);
  request.mutable_x()->add_shape(kernels::kProjectionInDim);
  request.mutable_x()->set_data(x.data(), x.size() * sizeof(float));
  auto stub = v1::ProjectionService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  auto reader = stub->Project(&context, request);
  v1::ProjectResponse chunk;
  int64_t next_row = 0, wrong_values = 0;
  while (reader->Read(&chunk)) {
    ASSERT_EQ(chunk.row_offset(), next_row);
    ASSERT_EQ(chunk.request_id(), "slow");
    ASSERT_EQ(chunk.determinism_key(), "key");
    ASSERT_EQ(chunk.y().shape_size(), 2);
    const int64_t rows = chunk.y().shape(0);
    ASSERT_EQ(chunk.y().data().size(), rows * kernels::kProjectionOutDim * 4);
    const float* y = reinterpret_cast<const float*>(chunk.y().data().data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < kernels::kProjectionOutDim; ++o) {
        const float want = x[(next_row + r) * kernels::kProjectionInDim] +
                           static_cast<float>(o);
        wrong_values += y[r * kernels::kProjectionOutDim + o] != want ? 1 : 0;
      }
    }
    next_row += rows;
    absl::SleepFor(absl::Milliseconds(5));  // the server runs ahead meanwhile
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(next_row, kRows);
  EXPECT_EQ(wrong_values, 0);
  ASSERT_TRUE(stream_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::MutexLock lock(&mu);
  ASSERT_EQ(streams.size(), 1u);
  EXPECT_EQ(streams[0].chunks, kChunks);
  // The ring ran full (the reader is slow) and never past its budget.
  EXPECT_EQ(streams[0].most_chunks_buffered, 3);
  // A buffer gRPC still holds after its write is replaced, not reused; that
  // is rare, and even then the stream holds a handful, not the video.
  EXPECT_LE(streams[0].buffers_allocated, 6);
  grpc_server->Shutdown();
  (*scheduler)->Stop();
  // Every chunk buffer came from the pool, and is back in it once gRPC let
  // go (every block idle); the pool frees them when its last reference goes.
  const server::HostBufferPool::Stats taken = pool->stats();
  EXPECT_EQ(taken.allocated + taken.reused, streams[0].buffers_allocated);
  EXPECT_EQ(taken.allocated, allocations.load());
  EXPECT_EQ(taken.heap_fallbacks, 0);
  // (The call frees its slots just after reporting its timings.)
  for (int i = 0; i < 500 && pool->stats().cached_bytes < pool->held_bytes();
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(pool->stats().cached_bytes, pool->held_bytes());
  EXPECT_GE(pool->held_bytes(), 3 * kChunkBytes);
  EXPECT_EQ(frees.load(), 0);
  pool.reset();
  options.chunk_buffers.reset();
  EXPECT_EQ(frees.load(), 0);  // the service still holds it
}

}  // namespace
}  // namespace detlogp
