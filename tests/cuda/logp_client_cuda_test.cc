// LogpClient's device path on a GPU: the real server binary on cuda:0, rows
// this process keeps in device memory (written on a stream of its own), and
// LogpClient::Score(DeviceRows) through the client's CUDA region (grown,
// sliced), through the host (region off, fp32 rows, spread over
// connections, the server refusing), a region the caller registers itself,
// and detlogp_cli score --cuda_shared_memory; every answer has the bits of
// the same rows sent as message bytes. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "tests/score_result_bits.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::DeviceRows;
using client::LogpClient;
using client::ScoreResult;
using testing::ExpectSameBits;
using testing::SameBits;
using testing::ServerProcess;
using v1::LogProbRequest;

constexpr int64_t kHidden = 4096;
constexpr int64_t kVocab = 32000;

bool HaveGpu() {
  int count = 0;
  const bool have = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();
  return have;
}

std::vector<std::string> GpuServerArgs(std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "--device=cuda:0", "--metrics_port=0",
      absl::StrCat("--synthetic_hidden_size=", kHidden),
      absl::StrCat("--synthetic_vocab_size=", kVocab)};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

client::LogProbOptions Extras() {
  client::LogProbOptions options;
  options.return_lse = true;
  options.return_entropy = true;
  options.top_k = 8;
  return options;
}

LogProbRequest Request(int64_t rows, uint64_t seed) {
  return client::MakeLogProbRequest(
      absl::StrCat("r", seed), v1::DTYPE_BFLOAT16, rows, kHidden,
      client::RandomBf16Rows(rows, kHidden, seed),
      client::RandomTargets(rows, kVocab, seed), Extras());
}

std::vector<int64_t> Targets(const LogProbRequest& request) {
  return {request.target_ids().begin(), request.target_ids().end()};
}

// Bytes copied to cuda:0 on a stream of their own, two bytes into the
// allocation (rows need no alignment); not waited for: the client orders
// its copy after them on the same stream.
class OnGpu {
 public:
  explicit OnGpu(const std::string& bytes) {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
              cudaSuccess);
    EXPECT_EQ(cudaMalloc(&base_, bytes.size() + 2), cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(static_cast<char*>(base_) + 2, bytes.data(),
                              bytes.size(), cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
  }
  ~OnGpu() {
    cudaStreamSynchronize(stream_);
    cudaFree(base_);
    cudaStreamDestroy(stream_);
  }
  DeviceRows Rows(v1::DType dtype, int64_t rows) const {
    DeviceRows device_rows;
    device_rows.data = static_cast<const char*>(base_) + 2;
    device_rows.device = 0;
    device_rows.dtype = dtype;
    device_rows.rows = rows;
    device_rows.hidden_size = kHidden;
    device_rows.stream = stream_;
    return device_rows;
  }

 private:
  void* base_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Whether the server process is still running, or how it ended.
std::string ProcessState(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, WNOHANG) != pid) return "server running";
  if (WIFSIGNALED(status)) {
    return absl::StrCat("server killed by signal ", WTERMSIG(status));
  }
  return absl::StrCat("server exited with ", WEXITSTATUS(status));
}

// A server on cuda:0 per case (the test's H and V).
class LogpClientCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    auto server = ServerProcess::Start(GpuServerArgs());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(SIGTERM), 0) << server_->Log();
    }
  }
  // What a failed call's message adds: the server's state and log.
  std::string ServerState() const {
    return absl::StrCat(ProcessState(server_->pid()), "\n", server_->Log());
  }

  std::unique_ptr<LogpClient> Connect(LogpClient::Options options = {}) {
    options.target = server_->target();
    auto client = LogpClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }
  // The rows as message bytes, one request.
  ScoreResult OverGrpc(const LogProbRequest& request) {
    LogpClient::Options whole;
    whole.split_large_calls = false;
    auto result = Connect(whole)->Score(request);
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return ScoreResult();
    EXPECT_EQ(result->path, "grpc");
    return *std::move(result);
  }

  std::unique_ptr<ServerProcess> server_;
};

TEST_F(LogpClientCudaTest, TheClientsCudaRegionGivesTheBitsOfBytes) {
  LogpClient::Options options;
  options.cuda_shared_memory = true;
  auto client = Connect(options);
  // Growing sizes: the last is larger than the region the first ones made.
  for (const int64_t rows : {1, 300, 4096, 9000}) {
    const LogProbRequest request = Request(rows, 10 + rows);
    const ScoreResult expected = OverGrpc(request);
    const OnGpu rows_on_gpu(request.hidden().data());
    auto result = client->Score(rows_on_gpu.Rows(v1::DTYPE_BFLOAT16, rows),
                                Targets(request), Extras(), "device");
    ASSERT_TRUE(result.ok()) << result.status() << "\n" << ServerState();
    EXPECT_EQ(result->path, "cuda_shm") << client->shared_memory_refusal();
    EXPECT_TRUE(result->used_shared_memory);
    EXPECT_EQ(result->request_id, "device");
    ExpectSameBits(expected, *result);
  }
  // One region, grown: the smaller ones were unregistered.
  auto status = client->CudaRegionStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->regions_size(), 1);
  EXPECT_GE(status->regions(0).byte_size(), 9000 * kHidden * 2);
  EXPECT_EQ(status->regions(0).device_id(), 0);
  EXPECT_EQ(status->regions(0).use().requests(), 1);
  client.reset();  // unregisters and frees it
  status = Connect()->CudaRegionStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->regions_size(), 0);
}

TEST_F(LogpClientCudaTest, ACallCutIntoRequestsNamesItsRowsInTheRegion) {
  LogpClient::Options options;
  options.cuda_shared_memory = true;
  options.max_request_rows = 1000;
  auto client = Connect(options);
  const LogProbRequest request = Request(4096, 77);
  const ScoreResult expected = OverGrpc(request);
  const OnGpu rows_on_gpu(request.hidden().data());
  auto sliced = client->Score(rows_on_gpu.Rows(v1::DTYPE_BFLOAT16, 4096),
                              Targets(request), Extras());
  ASSERT_TRUE(sliced.ok()) << sliced.status() << "\n" << ServerState();
  EXPECT_EQ(sliced->path, "cuda_shm");
  EXPECT_EQ(sliced->requests, 5);
  EXPECT_EQ(sliced->connections, 1);
  ExpectSameBits(expected, *sliced);
}

TEST_F(LogpClientCudaTest, WithoutTheRegionRowsGoThroughTheHost) {
  const LogProbRequest request = Request(4096, 5);  // 32 MiB of rows
  const ScoreResult expected = OverGrpc(request);
  const OnGpu rows_on_gpu(request.hidden().data());
  // Region off: copied to the host, spread over four connections.
  LogpClient::Options spread;
  spread.connections = 4;
  auto client = Connect(spread);
  auto over_host = client->Score(rows_on_gpu.Rows(v1::DTYPE_BFLOAT16, 4096),
                                 Targets(request), Extras());
  ASSERT_TRUE(over_host.ok()) << over_host.status();
  EXPECT_EQ(over_host->path, "grpc");
  EXPECT_EQ(over_host->connections, 4);
  ExpectSameBits(expected, *over_host);

  // fp32 rows (each bf16 value widened) with the region on: CUDA regions
  // hold bf16, so they go through the host, converted by the server.
  const std::string& bf16 = request.hidden().data();
  std::string fp32(bf16.size() * 2, '\0');
  for (size_t i = 0; i < bf16.size() / 2; ++i) {
    std::memcpy(&fp32[4 * i + 2], &bf16[2 * i], 2);
  }
  const OnGpu fp32_on_gpu(fp32);
  LogpClient::Options region;
  region.cuda_shared_memory = true;
  auto fp32_client = Connect(region);
  auto widened = fp32_client->Score(fp32_on_gpu.Rows(v1::DTYPE_FLOAT32, 4096),
                                    Targets(request), Extras());
  ASSERT_TRUE(widened.ok()) << widened.status();
  EXPECT_EQ(widened->path, "grpc");
  ExpectSameBits(expected, *widened);
  EXPECT_EQ(fp32_client->shared_memory_refusal(), "");

  // Rows on another GPU than rows.device say so.
  DeviceRows elsewhere = rows_on_gpu.Rows(v1::DTYPE_BFLOAT16, 4096);
  elsewhere.device = 1;
  auto refused = client->Score(elsewhere, Targets(request), Extras());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "rows.device:"))
      << refused.status();
}

TEST_F(LogpClientCudaTest, ARefusedRegionFallsBackAndSaysWhy) {
  auto server =
      ServerProcess::Start(GpuServerArgs({"--allow_shared_memory=false"}));
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options options;
  options.target = (*server)->target();
  options.cuda_shared_memory = true;
  auto client = *LogpClient::Create(options);
  const LogProbRequest request = Request(300, 9);
  const ScoreResult expected = OverGrpc(request);
  const OnGpu rows_on_gpu(request.hidden().data());
  for (int call = 0; call < 2; ++call) {
    auto result = client->Score(rows_on_gpu.Rows(v1::DTYPE_BFLOAT16, 300),
                                Targets(request), Extras());
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->path, "grpc");
    ExpectSameBits(expected, *result);
  }
  const std::string why = client->shared_memory_refusal();
  EXPECT_TRUE(absl::StartsWith(why, "cuda: FAILED_PRECONDITION")) << why;
  EXPECT_TRUE(absl::StrContains(why, "--allow_shared_memory")) << why;
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

TEST_F(LogpClientCudaTest, ACudaRegionTheCallerRegistersGivesTheBitsOfBytes) {
  auto client = Connect();
  const LogProbRequest request = Request(700, 21);
  const ScoreResult expected = OverGrpc(request);
  const std::string& rows = request.hidden().data();
  const int64_t offset = 1001;
  const int64_t bytes = offset + static_cast<int64_t>(rows.size());
  void* device = nullptr;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(static_cast<char*>(device) + offset, rows.data(),
                       rows.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, device), cudaSuccess);
  const std::string raw(reinterpret_cast<const char*>(&handle), sizeof(handle));
  ASSERT_EQ(static_cast<int>(raw.size()), client::CudaRuntime::kIpcHandleBytes);
  // Refusals name the field.
  const absl::Status other_gpu =
      client->RegisterCudaRegion("mine", raw, 77, bytes);
  EXPECT_EQ(other_gpu.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(other_gpu.message(), "device_id:")) << other_gpu;
  const absl::Status short_handle =
      client->RegisterCudaRegion("mine", raw.substr(0, 10), 0, bytes);
  EXPECT_TRUE(absl::StartsWith(short_handle.message(), "raw_handle:"))
      << short_handle;

  ASSERT_TRUE(client->RegisterCudaRegion("mine", raw, 0, bytes).ok());
  client::RegionRef ref;
  ref.region = "mine";
  ref.offset = offset;
  auto by_reference = client->Score(
      client::MakeLogProbRequest("mine", v1::DTYPE_BFLOAT16, 700, kHidden, ref,
                                 Targets(request), Extras()));
  ASSERT_TRUE(by_reference.ok()) << by_reference.status() << "\n"
                                 << ServerState();
  EXPECT_EQ(by_reference->path, "named_region");
  ExpectSameBits(expected, *by_reference);
  auto status = client->CudaRegionStatus("mine");
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->regions_size(), 1);
  EXPECT_EQ(status->regions(0).use().requests(), 1);
  ASSERT_TRUE(client->UnregisterCudaRegion("mine").ok());
  cudaFree(device);
}

// "row ..." lines of the CLI's output, and its "timing" line's path.
std::vector<std::string> RowLines(const std::string& out) {
  std::vector<std::string> rows;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, "row ")) rows.emplace_back(line);
  }
  return rows;
}

std::string TimingPath(const std::string& out) {
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::StartsWith(line, "timing ")) continue;
    const size_t at = line.find(" path ");
    if (at != absl::string_view::npos) {
      return std::string(line.substr(at + 6));
    }
  }
  return "";
}

TEST_F(LogpClientCudaTest, TheCliScoresRowsUploadedToTheGpu) {
  const std::string common =
      absl::StrCat("score --target=", server_->target(),
                   " --random_rows=3000 --seed=4 --return_lse --entropy "
                   "--top_k=4 --timing");
  auto [plain_code, plain] = testing::RunCli(common + " 2>&1");
  ASSERT_EQ(plain_code, 0) << plain;
  auto [device_code, device] =
      testing::RunCli(common + " --cuda_shared_memory --score_repeats=2 2>&1");
  ASSERT_EQ(device_code, 0) << device;
  EXPECT_EQ(TimingPath(plain), "grpc") << plain;
  EXPECT_EQ(TimingPath(device), "cuda_shm") << device;
  ASSERT_EQ(RowLines(plain).size(), 3000u);
  EXPECT_EQ(RowLines(plain), RowLines(device));
}

}  // namespace
}  // namespace detlogp
