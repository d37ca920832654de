// The CUDA C ABI while the caller's stream captures a CUDA graph, as
// torch.cuda.graph and torch.compile(mode="reduce-overhead") call it: a head
// made during a global-mode capture, the forward, the fused backward (on
// compute capability 9.0) and the H3 projection's three kernels captured
// once and replayed give the bits of the same calls made directly (memcmp),
// and a replay reads the inputs' current contents. Skipped without a usable
// GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/capi/detlogp_ops_cuda.h"

namespace {

constexpr int64_t kRows = 80;
constexpr int64_t kHidden = 128;
constexpr int64_t kPadded = 4224;  // two of the backward's column chunks
constexpr int64_t kVocab = 4200;
constexpr int64_t kProjectionRows = 9;
constexpr int64_t kInDim = 96;
constexpr int64_t kOutDim = 5376;
constexpr size_t kErrorLen = 1024;

// A device allocation, zeroed, freed at scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&data_, bytes) != cudaSuccess ||
        cudaMemset(data_, 0, bytes) != cudaSuccess) {
      data_ = nullptr;
    }
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <class T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  bool ok() const { return data_ != nullptr; }

  template <class T>
  bool Upload(const std::vector<T>& host) {
    return host.size() * sizeof(T) == bytes_ &&
           cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice) ==
               cudaSuccess;
  }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> host(bytes_);
    if (cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost) !=
        cudaSuccess) {
      host.clear();
    }
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> out(n);
  for (float& v : out) v = normal(rng);
  return out;
}

// bf16 bits of random values (the top half of each float: any bf16 will do).
std::vector<uint16_t> RandomBf16(size_t n, uint32_t seed, float scale) {
  std::vector<uint16_t> out(n);
  const std::vector<float> values = RandomFloats(n, seed, scale);
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &values[i], sizeof(bits));
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// Skips unless cuda:0 can run the ops; true when it has the backward.
bool UsableDevice(std::string* why) {
  char error[kErrorLen];
  if (detlogp_cuda_check_device(0, error, kErrorLen) != 0) {
    *why = error;
    return false;
  }
  return true;
}

bool HasBackward() {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major == 9 && minor == 0;
}

// Where one forward and backward write.
struct LogpOutputs {
  DeviceBuffer logprobs{sizeof(float) * kRows};
  DeviceBuffer lse{sizeof(float) * kRows};
  DeviceBuffer entropy{sizeof(float) * kRows};
  DeviceBuffer grad_hidden{sizeof(uint16_t) * kRows * kHidden};
  DeviceBuffer grad_weight{sizeof(float) * kPadded * kHidden};
  DeviceBuffer grad_bias{sizeof(float) * kPadded};
  std::vector<std::vector<uint8_t>> Download(bool backward) const {
    std::vector<std::vector<uint8_t>> all = {
        logprobs.Download(), lse.Download(), entropy.Download()};
    if (backward) {
      all.push_back(grad_hidden.Download());
      all.push_back(grad_weight.Download());
      all.push_back(grad_bias.Download());
    }
    return all;
  }
};

class LinearLogpCaptureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!UsableDevice(&why)) GTEST_SKIP() << why;
    backward_ = HasBackward();
    std::vector<int32_t> targets(kRows);
    std::mt19937 rng(7);
    for (int32_t& t : targets) t = static_cast<int32_t>(rng() % kVocab);
    std::vector<float> temperatures = RandomFloats(kRows, 8, 0.2f);
    for (float& t : temperatures) t = 1.0f + std::abs(t);
    ASSERT_TRUE(weight_.Upload(RandomBf16(kPadded * kHidden, 1, 0.3f)));
    ASSERT_TRUE(bias_.Upload(RandomFloats(kPadded, 2, 0.5f)));
    ASSERT_TRUE(hidden_.Upload(RandomBf16(kRows * kHidden, 3, 1.0f)));
    ASSERT_TRUE(targets_.Upload(targets));
    ASSERT_TRUE(temperatures_.Upload(temperatures));
    for (int i = 0; i < 3; ++i) {
      upstream_.emplace_back(
          std::make_unique<DeviceBuffer>(sizeof(float) * kRows));
      ASSERT_TRUE(upstream_.back()->Upload(RandomFloats(kRows, 10 + i, 1.0f)));
    }
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
              cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  detlogp_cuda_lm_head* NewHead() {
    detlogp_cuda_lm_head* head = nullptr;
    char error[kErrorLen];
    EXPECT_EQ(detlogp_cuda_lm_head_create(weight_.get(), kPadded, kHidden,
                                          bias_.get<float>(), kVocab, 0, &head,
                                          error, kErrorLen),
              0)
        << error;
    return head;
  }

  // The forward, then (with the kernel) the backward into `out`; 0 or the
  // first call's nonzero status (its message in *why).
  int Run(const detlogp_cuda_lm_head* head, LogpOutputs& out,
          DeviceBuffer& workspace, DeviceBuffer& backward_workspace,
          std::string* why) {
    char error[kErrorLen];
    int rc = detlogp_cuda_linear_logp(
        head, hidden_.get(), kRows, targets_.get(), 0,
        temperatures_.get<float>(), 1.0f, out.logprobs.get<float>(),
        out.lse.get<float>(), out.entropy.get<float>(), workspace.get(),
        workspace.bytes(), stream_, error, kErrorLen);
    if (rc == 0 && backward_) {
      rc = detlogp_cuda_linear_logp_backward(
          head, hidden_.get(), kRows, targets_.get(), 0,
          temperatures_.get<float>(), 1.0f, out.lse.get<float>(),
          out.entropy.get<float>(), upstream_[0]->get<float>(),
          upstream_[1]->get<float>(), upstream_[2]->get<float>(),
          out.grad_hidden.get(), 1, out.grad_weight.get(), 0,
          out.grad_bias.get<float>(), backward_workspace.get(),
          backward_workspace.bytes(), stream_, error, kErrorLen);
    }
    if (rc != 0) *why = error;
    return rc;
  }

  size_t ForwardWorkspaceBytes(const detlogp_cuda_lm_head* head) const {
    return static_cast<size_t>(
        detlogp_cuda_linear_logp_workspace_bytes(head, kRows, 1));
  }
  size_t BackwardWorkspaceBytes(const detlogp_cuda_lm_head* head) const {
    if (!backward_) return 256;
    return static_cast<size_t>(
        detlogp_cuda_linear_logp_backward_workspace_bytes(head, kRows, 1, 1));
  }

  bool backward_ = false;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer weight_{sizeof(uint16_t) * kPadded * kHidden};
  DeviceBuffer bias_{sizeof(float) * kPadded};
  DeviceBuffer hidden_{sizeof(uint16_t) * kRows * kHidden};
  DeviceBuffer targets_{sizeof(int32_t) * kRows};
  DeviceBuffer temperatures_{sizeof(float) * kRows};
  std::vector<std::unique_ptr<DeviceBuffer>> upstream_;
};

TEST_F(LinearLogpCaptureTest, AHeadMadeDuringCaptureReplaysTheDirectBits) {
  detlogp_cuda_lm_head* direct_head = NewHead();
  ASSERT_NE(direct_head, nullptr);
  DeviceBuffer direct_workspace(ForwardWorkspaceBytes(direct_head));
  DeviceBuffer direct_backward_workspace(BackwardWorkspaceBytes(direct_head));
  LogpOutputs direct;
  std::string why;
  ASSERT_EQ(Run(direct_head, direct, direct_workspace,
                direct_backward_workspace, &why),
            0)
      << why;
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const auto want = direct.Download(backward_);

  // Everything the captured calls write or use is allocated before the
  // capture (PyTorch's allocator does the same from its graph pool); the
  // head itself is made inside it.
  DeviceBuffer workspace(direct_workspace.bytes());
  DeviceBuffer backward_workspace(direct_backward_workspace.bytes());
  LogpOutputs captured;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  detlogp_cuda_lm_head* head = NewHead();
  const int rc = head == nullptr
                     ? -1
                     : Run(head, captured, workspace, backward_workspace, &why);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  ASSERT_EQ(rc, 0) << why;
  ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // Nothing ran during the capture: the outputs are still zero.
  for (const auto& bytes : captured.Download(backward_)) {
    EXPECT_EQ(bytes, std::vector<uint8_t>(bytes.size(), 0));
  }
  ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const auto got = captured.Download(backward_);
  const char* names[] = {"logprobs",    "lse",         "entropy",
                         "grad_hidden", "grad_weight", "grad_bias"};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i], want[i]) << names[i] << " differs from the direct call";
  }

  // A replay reads the inputs as they are now (new hidden rows, in place).
  ASSERT_TRUE(hidden_.Upload(RandomBf16(kRows * kHidden, 4, 1.0f)));
  ASSERT_EQ(Run(direct_head, direct, direct_workspace,
                direct_backward_workspace, &why),
            0)
      << why;
  ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const auto want_again = direct.Download(backward_);
  const auto got_again = captured.Download(backward_);
  for (size_t i = 0; i < want_again.size(); ++i) {
    EXPECT_EQ(got_again[i], want_again[i])
        << names[i] << " differs after new hidden rows";
  }
  EXPECT_NE(want_again[0], want[0]);  // the rows really changed

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  // Destroying heads frees host memory only; the graph was already made.
  detlogp_cuda_lm_head_destroy(head);
  detlogp_cuda_lm_head_destroy(direct_head);
}

TEST(ProjectionCaptureTest, ForwardAndGradientsReplayTheDirectBits) {
  std::string why;
  if (!UsableDevice(&why)) GTEST_SKIP() << why;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  DeviceBuffer x(sizeof(float) * kProjectionRows * kInDim);
  DeviceBuffer weight(sizeof(float) * kOutDim * kInDim);
  DeviceBuffer bias(sizeof(float) * kOutDim);
  DeviceBuffer dy(sizeof(float) * kProjectionRows * kOutDim);
  ASSERT_TRUE(x.Upload(RandomFloats(kProjectionRows * kInDim, 20, 1.0f)));
  ASSERT_TRUE(weight.Upload(RandomFloats(kOutDim * kInDim, 21, 0.1f)));
  ASSERT_TRUE(bias.Upload(RandomFloats(kOutDim, 22, 0.5f)));
  ASSERT_TRUE(dy.Upload(RandomFloats(kProjectionRows * kOutDim, 23, 1.0f)));
  const int64_t forward_bytes =
      detlogp_cuda_h3_projection_forward_workspace_bytes();
  const int64_t dx_bytes =
      detlogp_cuda_h3_projection_input_grad_workspace_bytes(kProjectionRows);
  const int64_t dw_bytes =
      detlogp_cuda_h3_projection_weight_grad_workspace_bytes(kProjectionRows,
                                                             0);
  ASSERT_GE(dx_bytes, 0);
  ASSERT_GE(dw_bytes, 0);

  struct Outputs {
    DeviceBuffer y{sizeof(float) * kProjectionRows * kOutDim};
    DeviceBuffer dx{sizeof(float) * kProjectionRows * kInDim};
    DeviceBuffer dweight{sizeof(float) * kOutDim * kInDim};
    DeviceBuffer dbias{sizeof(float) * kOutDim};
  };
  auto run = [&](Outputs& out, DeviceBuffer& ws_forward, DeviceBuffer& ws_dx,
                 DeviceBuffer& ws_dw) {
    char error[kErrorLen];
    int rc = detlogp_cuda_h3_projection_forward(
        x.get<float>(), kProjectionRows, weight.get<float>(), bias.get<float>(),
        out.y.get<float>(), ws_forward.get(), ws_forward.bytes(), 0, stream,
        error, kErrorLen);
    if (rc == 0) {
      rc = detlogp_cuda_h3_projection_input_grad(
          dy.get<float>(), kProjectionRows, weight.get<float>(),
          out.dx.get<float>(), ws_dx.get(), ws_dx.bytes(), 0, stream, error,
          kErrorLen);
    }
    if (rc == 0) {
      rc = detlogp_cuda_h3_projection_weight_grad(
          dy.get<float>(), x.get<float>(), kProjectionRows, 0,
          out.dweight.get<float>(), out.dbias.get<float>(), ws_dw.get(),
          ws_dw.bytes(), 0, stream, error, kErrorLen);
    }
    if (rc != 0) why = error;
    return rc;
  };
  // At least one byte each: a zero-byte allocation may give a null pointer.
  auto workspace = [](int64_t bytes) {
    return std::make_unique<DeviceBuffer>(std::max<int64_t>(bytes, 256));
  };
  Outputs direct, captured;
  auto f1 = workspace(forward_bytes), x1 = workspace(dx_bytes),
       w1 = workspace(dw_bytes);
  auto f2 = workspace(forward_bytes), x2 = workspace(dx_bytes),
       w2 = workspace(dw_bytes);
  ASSERT_EQ(run(direct, *f1, *x1, *w1), 0) << why;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  const int rc = run(captured, *f2, *x2, *w2);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_EQ(rc, 0) << why;
  ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(captured.y.Download(), direct.y.Download()) << "y";
  EXPECT_EQ(captured.dx.Download(), direct.dx.Download()) << "dx";
  EXPECT_EQ(captured.dweight.Download(), direct.dweight.Download())
      << "dweight";
  EXPECT_EQ(captured.dbias.Download(), direct.dbias.Download()) << "dbias";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
