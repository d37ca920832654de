// CUDA shared-memory regions end to end on a GPU: the real server binary on
// cuda:0, rows this process keeps in device memory (cudaMalloc, exported
// with cudaIpcGetMemHandle) and in a system region (pinned by the server),
// against the same rows sent in the message: the same bits, alone and mixed
// in shared batches. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "client/system_shared_memory.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "tests/score_result_bits.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using client::ScoreResult;
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

// Whether the server process is still running, or how it ended.
std::string ProcessState(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, WNOHANG) != pid) return "server running";
  if (WIFSIGNALED(status)) {
    return absl::StrCat("server killed by signal ", WTERMSIG(status));
  }
  return absl::StrCat("server exited with ", WEXITSTATUS(status));
}

// A server on cuda:0 whose synthetic model has the test's H and V.
std::vector<std::string> GpuServerArgs() {
  return {"--device=cuda:0", "--metrics_port=0",
          absl::StrCat("--synthetic_hidden_size=", kHidden),
          absl::StrCat("--synthetic_vocab_size=", kVocab)};
}

LogProbRequest Request(int64_t rows, uint64_t seed) {
  client::LogProbOptions options;
  options.return_lse = true;
  options.return_entropy = true;
  options.top_k = 8;
  return client::MakeLogProbRequest(
      absl::StrCat("r", seed), v1::DTYPE_BFLOAT16, rows, kHidden,
      client::RandomBf16Rows(rows, kHidden, seed),
      client::RandomTargets(rows, kVocab, seed), options);
}

LogProbRequest ByReference(LogProbRequest request, const std::string& region,
                           int64_t offset) {
  const int64_t bytes = static_cast<int64_t>(request.hidden().data().size());
  request.mutable_hidden()->clear_data();
  v1::SharedMemoryRef* ref = request.mutable_hidden()->mutable_shared_memory();
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(bytes);
  return request;
}

class Regions {
 public:
  explicit Regions(const std::string& target)
      : stub_(v1::SharedMemoryService::NewStub(
            grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))) {}
  grpc::Status RegisterCuda(const std::string& name, const std::string& handle,
                            int64_t device, int64_t bytes) {
    v1::CudaSharedMemoryRegisterRequest request;
    request.set_name(name);
    request.set_raw_handle(handle);
    request.set_device_id(device);
    request.set_byte_size(bytes);
    grpc::ClientContext context;
    v1::CudaSharedMemoryRegisterResponse response;
    return stub_->CudaSharedMemoryRegister(&context, request, &response);
  }
  grpc::Status RegisterSystem(const std::string& name, const std::string& key,
                              int64_t bytes) {
    v1::SystemSharedMemoryRegisterRequest request;
    request.set_name(name);
    request.set_key(key);
    request.set_byte_size(bytes);
    grpc::ClientContext context;
    v1::SystemSharedMemoryRegisterResponse response;
    return stub_->SystemSharedMemoryRegister(&context, request, &response);
  }
  grpc::Status UnregisterSystem(const std::string& name) {
    v1::SystemSharedMemoryUnregisterRequest request;
    request.set_name(name);
    grpc::ClientContext context;
    v1::SystemSharedMemoryUnregisterResponse response;
    return stub_->SystemSharedMemoryUnregister(&context, request, &response);
  }
  grpc::Status UnregisterCuda(const std::string& name) {
    v1::CudaSharedMemoryUnregisterRequest request;
    request.set_name(name);
    grpc::ClientContext context;
    v1::CudaSharedMemoryUnregisterResponse response;
    return stub_->CudaSharedMemoryUnregister(&context, request, &response);
  }

 private:
  std::unique_ptr<v1::SharedMemoryService::Stub> stub_;
};

TEST(SharedMemoryCudaTest, CudaAndPinnedRegionsGiveTheBitsOfMessageBytes) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  auto server = ServerProcess::Start(GpuServerArgs());
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options options;
  options.target = (*server)->target();
  auto client = *LogpClient::Create(options);
  Regions regions((*server)->target());

  // Requests of several sizes, laid out one after another (odd offsets
  // included) in a device buffer and in a system region.
  const std::vector<int64_t> sizes = {1, 7, 300, 4096, 9000};
  std::vector<LogProbRequest> requests;
  std::vector<int64_t> offsets;
  int64_t total = 2;  // a 2-byte lead: rows need no alignment
  for (size_t i = 0; i < sizes.size(); ++i) {
    requests.push_back(Request(sizes[i], 40 + i));
    offsets.push_back(total);
    total += static_cast<int64_t>(requests.back().hidden().data().size());
  }
  void* device = nullptr;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&device, total), cudaSuccess);
  auto host = client::SystemSharedMemory::Create(total);
  ASSERT_TRUE(host.ok()) << host.status();
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string& data = requests[i].hidden().data();
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(device) + offsets[i], data.data(),
                         data.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    std::memcpy((*host)->data() + offsets[i], data.data(), data.size());
  }
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, device), cudaSuccess);
  const std::string raw(reinterpret_cast<const char*>(&handle), sizeof(handle));

  // Refusals name their field and register nothing.
  const grpc::Status short_handle = regions.RegisterCuda("g", "abc", 0, total);
  EXPECT_EQ(short_handle.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(short_handle.error_message(), "raw_handle:"));
  const grpc::Status other_gpu = regions.RegisterCuda("g", raw, 77, total);
  EXPECT_EQ(other_gpu.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(other_gpu.error_message(), "device_id:"));
  const grpc::Status too_big =
      regions.RegisterCuda("g", raw, 0, total + (64 << 20));
  EXPECT_EQ(too_big.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << too_big.error_message();
  EXPECT_TRUE(absl::StartsWith(too_big.error_message(), "byte_size:"));

  ASSERT_TRUE(regions.RegisterCuda("g", raw, 0, total).ok());
  ASSERT_TRUE(regions.RegisterSystem("h", (*host)->key(), total).ok());
  EXPECT_TRUE(absl::StrContains((*server)->Log(), "pinned for direct copies"))
      << (*server)->Log();

  // Alone: each path against message bytes.
  std::vector<ScoreResult> expected;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto over_grpc = client->Score(requests[i]);
    ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
    for (const char* region : {"g", "h"}) {
      auto by_ref = client->Score(ByReference(requests[i], region, offsets[i]));
      ASSERT_TRUE(by_ref.ok()) << region << ": " << by_ref.status() << "\n"
                               << ProcessState((*server)->pid()) << "\n"
                               << (*server)->Log();
      EXPECT_TRUE(SameBits(*over_grpc, *by_ref))
          << region << ", " << sizes[i] << " rows";
    }
    expected.push_back(*std::move(over_grpc));
  }

  // Mixed: many callers at once, so batches hold staged, pinned and device
  // rows side by side (the executor copies around the direct ones).
  std::vector<std::thread> callers;
  std::atomic<int> mismatches{0}, failures{0};
  for (int caller = 0; caller < 12; ++caller) {
    callers.emplace_back([&, caller] {
      auto own = *LogpClient::Create(options);
      for (int round = 0; round < 6; ++round) {
        const size_t i = (caller + round) % requests.size();
        const int path = (caller + 2 * round) % 3;
        const LogProbRequest request =
            path == 0
                ? requests[i]
                : ByReference(requests[i], path == 1 ? "g" : "h", offsets[i]);
        auto result = own->Score(request);
        if (!result.ok()) {
          ++failures;
        } else if (!SameBits(*result, expected[i])) {
          ++mismatches;
        }
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);

  // A device region in use stays; once idle it goes, and the handle closes.
  ASSERT_TRUE(regions.UnregisterCuda("g").ok());
  auto gone = client->Score(ByReference(requests[0], "g", offsets[0]));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  auto text = (*server)->HttpGet("/metrics");
  ASSERT_TRUE(text.ok());
  EXPECT_TRUE(absl::StrContains(
      *text, "detlogp_hidden_bytes_total{path=\"cuda_shm\"}"));
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
  cudaFree(device);
}

// A pinned system region whose owner truncates the object: requests naming
// it are refused naming hidden.shared_memory, everything else keeps its
// bits, and the region unpins and unregisters cleanly.
TEST(SharedMemoryCudaTest, APinnedRegionItsOwnerTruncatedFailsOnlyItsRequests) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  auto server = ServerProcess::Start(GpuServerArgs());
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options options;
  options.target = (*server)->target();
  auto client = *LogpClient::Create(options);
  Regions regions((*server)->target());
  const LogProbRequest request = Request(300, 60);
  const std::string& data = request.hidden().data();
  const int64_t at = 8 << 20;  // past the page left after the truncation
  auto host = client::SystemSharedMemory::Create(at + data.size());
  ASSERT_TRUE(host.ok()) << host.status();
  std::memcpy((*host)->data() + at, data.data(), data.size());
  ASSERT_TRUE(
      regions.RegisterSystem("h", (*host)->key(), (*host)->bytes()).ok());
  EXPECT_TRUE(absl::StrContains((*server)->Log(), "pinned for direct copies"));
  auto expected = client->Score(request);
  ASSERT_TRUE(expected.ok()) << expected.status();
  auto before = client->Score(ByReference(request, "h", at));
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_TRUE(SameBits(*expected, *before));

  const int fd = shm_open((*host)->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  for (int i = 0; i < 3; ++i) {
    auto refused = client->Score(ByReference(request, "h", at));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
        << refused.status();
    EXPECT_TRUE(absl::StartsWith(refused.status().message(),
                                 "hidden.shared_memory: region \"h\" shrank"))
        << refused.status();
    auto answered = client->Score(request);
    ASSERT_TRUE(answered.ok()) << answered.status();
    EXPECT_TRUE(SameBits(*expected, *answered));
  }
  ASSERT_TRUE(regions.UnregisterSystem("h").ok());
  auto after = client->Score(request);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(SameBits(*expected, *after));
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

}  // namespace
}  // namespace detlogp
