// The C ABI over the CUDA kernels (detlogp_ops_cuda.h). Each entry point
// validates its host-side arguments, then launches the same kernels the CUDA
// server's backend launches (kernels/cuda/), on the caller's stream, into the
// caller's buffers.
#include "kernels/capi/detlogp_ops_cuda.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/capi/capi_util.h"
#include "kernels/cuda/kernel_kind.h"
#include "kernels/cuda/linear_logp_backward_cuda.h"
#include "kernels/cuda/linear_logp_cuda.h"
#include "kernels/cuda/projection_cuda.h"
#include "kernels/projection.h"

struct detlogp_cuda_lm_head {
  std::unique_ptr<detlogp::kernels::cuda::LinearLogpCuda> kernel;
  // The linear-logp backward (Hopper only; null on other GPUs).
  std::unique_ptr<detlogp::kernels::cuda::LinearLogpBackwardCuda> backward;
};

namespace {

using detlogp::capi::CheckHead;
using detlogp::capi::ClearError;
using detlogp::capi::Fail;
using detlogp::kernels::kProjectionInDim;
using detlogp::kernels::kProjectionMaxRows;
using detlogp::kernels::kProjectionOutDim;
using detlogp::kernels::ProjectionCuda;
using detlogp::kernels::cuda::GradDtype;
using detlogp::kernels::cuda::KernelKind;
using detlogp::kernels::cuda::LinearLogpBackwardCuda;
using detlogp::kernels::cuda::LinearLogpCuda;
using detlogp::kernels::cuda::LinearLogpGradView;

constexpr int64_t kTransposeBytes =
    static_cast<int64_t>(sizeof(float)) * kProjectionOutDim * kProjectionInDim;

bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

int FailStatus(const absl::Status& status, char* error, size_t error_len) {
  return Fail(std::string(status.message()), error, error_len);
}

// The linear-logp kernel `device` runs (the server's --logp_kernel=auto
// rule), or why none can.
absl::StatusOr<detlogp::kernels::cuda::KernelKind> KernelForDevice(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                             device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                             device) != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("device: cannot query cuda:", device));
  }
  auto kernel = detlogp::kernels::cuda::DefaultKernelFor(major, minor);
  if (!kernel.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("device: cuda:", device, " is sm_", major, minor, ": ",
                     kernel.status().message()));
  }
  return kernel;
}

// Empty when `device` is a GPU of compute capability >= 8.0 this process can
// use.
std::string DeviceProblem(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    return absl::StrCat("no usable CUDA driver or device: ",
                        cudaGetErrorString(err));
  }
  if (count == 0) return "no CUDA device on this machine";
  if (device < 0 || device >= count) {
    return absl::StrCat("device: cuda:", device, " requested but ", count,
                        " GPU(s) visible");
  }
  auto kernel = KernelForDevice(device);
  return kernel.ok() ? "" : std::string(kernel.status().message());
}

// Relaxes this thread's stream-capture mode for its lifetime. The set-up
// calls of a head or a projection (device properties, kernel attributes,
// tensor-map encoding) touch no stream and allocate nothing, but a capture
// in the global mode (torch.cuda.graph's default) would still refuse them
// and invalidate itself; with the mode relaxed they run, and the launches
// that follow are captured as usual.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// A ProjectionCuda over the caller's buffers (no copy, no allocation).
absl::StatusOr<std::unique_ptr<ProjectionCuda>> WrapProjection(
    const float* weight, const float* weight_t, const float* bias, int device) {
  RelaxedCaptureMode relaxed;
  ProjectionCuda::Options options;
  options.weight = weight;
  options.weight_t = weight_t;
  options.bias = bias;
  options.device = device;
  options.wrap = true;
  return ProjectionCuda::Create(options);
}

// Shared checks of the projection entry points; empty when sane.
std::string CheckProjectionRows(int64_t rows) {
  if (rows < 0 || rows > kProjectionMaxRows) {
    return absl::StrCat("rows: must be in [0, ", kProjectionMaxRows, "], got ",
                        rows);
  }
  return "";
}

std::string CheckDevicePointer(const void* p, const char* name,
                               bool may_be_null) {
  if (p == nullptr) {
    return may_be_null ? "" : absl::StrCat(name, ": null pointer");
  }
  if (!Aligned(p, 16)) return absl::StrCat(name, ": not 16-byte aligned");
  return "";
}

// Empty when `targets` is aligned for its type (or null where allowed).
std::string TargetsProblem(const void* targets, int targets_are_int64,
                           bool required) {
  if (targets == nullptr) return required ? "targets: null pointer" : "";
  if (targets_are_int64 != 0) {
    return Aligned(targets, 8) ? "" : "targets: int64 but not 8-byte aligned";
  }
  return Aligned(targets, 4) ? "" : "targets: not 4-byte aligned";
}

// Points a kernel view's int32 or int64 targets at the caller's array.
template <class View>
void SetTargets(const void* targets, int targets_are_int64, View* view) {
  if (targets_are_int64 != 0) {
    view->targets64 = static_cast<const int64_t*>(targets);
  } else {
    view->targets = static_cast<const int32_t*>(targets);
  }
}

// The backward's view of a call; `bad` names the first bad argument.
LinearLogpGradView GradView(const void* hidden, int64_t rows,
                            const void* targets, int targets_are_int64,
                            const float* temperatures, float temperature,
                            const float* lse, const float* entropy,
                            const float* grad_logprobs, const float* grad_lse,
                            const float* grad_entropy, void* grad_hidden,
                            int grad_hidden_bf16, void* grad_weight,
                            int grad_weight_bf16, float* grad_bias,
                            std::string* bad) {
  LinearLogpGradView v;
  v.hidden = static_cast<const __nv_bfloat16*>(hidden);
  v.rows = rows;
  *bad = TargetsProblem(targets, targets_are_int64, false);
  SetTargets(targets, targets_are_int64, &v);
  v.temperatures = temperatures;
  v.temperature = temperature;
  v.lse = lse;
  v.entropy = entropy;
  v.grad_logprobs = grad_logprobs;
  v.grad_lse = grad_lse;
  v.grad_entropy = grad_entropy;
  v.grad_hidden = grad_hidden;
  v.grad_hidden_dtype =
      grad_hidden_bf16 != 0 ? GradDtype::kBfloat16 : GradDtype::kFloat32;
  v.grad_weight = grad_weight;
  v.grad_weight_dtype =
      grad_weight_bf16 != 0 ? GradDtype::kBfloat16 : GradDtype::kFloat32;
  v.grad_bias = grad_bias;
  return v;
}

std::string NoBackward(const detlogp_cuda_lm_head* head) {
  if (head == nullptr) return "head: null pointer";
  if (head->backward == nullptr) {
    return absl::StrCat("device: the linear-logp backward kernel (",
                        LinearLogpBackwardCuda::KernelVersion(),
                        ") needs compute capability 9.0 (sm_90a)");
  }
  return "";
}

}  // namespace

extern "C" {

int detlogp_ops_cuda_abi_version(void) { return DETLOGP_OPS_CUDA_ABI_VERSION; }

int detlogp_cuda_check_device(int device, char* error, size_t error_len) {
  try {
    ClearError(error, error_len);
    const std::string problem = DeviceProblem(device);
    return problem.empty() ? 0 : Fail(problem, error, error_len);
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int detlogp_cuda_lm_head_create(const void* weight, int64_t padded_vocab_size,
                                int64_t hidden_size, const float* bias,
                                int64_t vocab_size, int device,
                                detlogp_cuda_lm_head** head, char* error,
                                size_t error_len) {
  try {
    ClearError(error, error_len);
    RelaxedCaptureMode relaxed;  // a head may be made while a graph captures
    if (head == nullptr) return Fail("head: null pointer", error, error_len);
    *head = nullptr;
    std::string bad =
        CheckHead(weight, padded_vocab_size, hidden_size, vocab_size);
    if (bad.empty()) bad = CheckDevicePointer(weight, "weight", false);
    if (bad.empty() && bias != nullptr && !Aligned(bias, 8)) {
      bad = "bias: not 8-byte aligned";
    }
    if (bad.empty()) bad = DeviceProblem(device);
    if (!bad.empty()) return Fail(bad, error, error_len);
    auto kernel_kind = KernelForDevice(device);
    if (!kernel_kind.ok()) {
      return FailStatus(kernel_kind.status(), error, error_len);
    }
    LinearLogpCuda::Options options;
    options.kernel = *kernel_kind;
    // The ops never ask for top-k, and the floors' column sample would cost
    // an allocation and a synchronisation: neither may run while a CUDA
    // graph captures, nor belongs in a call that only builds a handle.
    options.top_k_floors = false;
    options.weights.weight = static_cast<const __nv_bfloat16*>(weight);
    options.weights.bias = bias;
    options.weights.hidden_size = hidden_size;
    options.weights.vocab_size = vocab_size;
    options.weights.padded_vocab_size = padded_vocab_size;
    options.device = device;
    auto kernel = LinearLogpCuda::Create(options);
    if (!kernel.ok()) return FailStatus(kernel.status(), error, error_len);
    auto result = std::make_unique<detlogp_cuda_lm_head>();
    result->kernel = std::move(*kernel);
    if (*kernel_kind == KernelKind::kHopper) {
      auto backward =
          LinearLogpBackwardCuda::Create({options.weights, options.device});
      if (!backward.ok())
        return FailStatus(backward.status(), error, error_len);
      result->backward = std::move(*backward);
    }
    *head = result.release();
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

void detlogp_cuda_lm_head_destroy(detlogp_cuda_lm_head* head) { delete head; }

int64_t detlogp_cuda_linear_logp_workspace_bytes(
    const detlogp_cuda_lm_head* head, int64_t rows, int return_entropy) {
  if (head == nullptr || rows < 0) return -1;
  return static_cast<int64_t>(
      head->kernel->WorkspaceBytes(rows, return_entropy != 0));
}

int detlogp_cuda_linear_logp(const detlogp_cuda_lm_head* head,
                             const void* hidden, int64_t rows,
                             const void* targets, int targets_are_int64,
                             const float* temperatures, float temperature,
                             float* logprobs, float* lse, float* entropy,
                             void* workspace, size_t workspace_bytes,
                             void* stream, char* error, size_t error_len) {
  try {
    ClearError(error, error_len);
    if (head == nullptr) return Fail("head: null pointer", error, error_len);
    if (rows < 0) {
      return Fail(absl::StrCat("rows: must be >= 0, got ", rows), error,
                  error_len);
    }
    if (rows == 0) return 0;
    std::string bad = CheckDevicePointer(hidden, "hidden", false);
    if (bad.empty()) bad = TargetsProblem(targets, targets_are_int64, true);
    if (bad.empty() && temperatures == nullptr &&
        !(std::isfinite(temperature) && temperature > 0.0f)) {
      bad = absl::StrCat("temperature: must be finite and > 0, got ",
                         temperature);
    }
    if (bad.empty() && logprobs == nullptr) bad = "logprobs: null pointer";
    if (bad.empty() && lse == nullptr) bad = "lse: null pointer";
    const size_t need = head->kernel->WorkspaceBytes(rows, entropy != nullptr);
    if (bad.empty() && workspace_bytes < need) {
      bad = absl::StrCat("workspace_bytes: need ", need, " for ", rows,
                         " rows, got ", workspace_bytes);
    }
    if (bad.empty() && (workspace == nullptr || !Aligned(workspace, 4))) {
      bad = "workspace: null or not 4-byte aligned";
    }
    if (!bad.empty()) return Fail(bad, error, error_len);
    detlogp::kernels::cuda::LinearLogpBatchView batch;
    batch.hidden = static_cast<const __nv_bfloat16*>(hidden);
    SetTargets(targets, targets_are_int64, &batch);
    batch.temperatures = temperatures;
    batch.temperature = temperature;
    batch.logprobs = logprobs;
    batch.lse = lse;
    batch.entropy = entropy;
    batch.rows = rows;
    const absl::Status status = head->kernel->Launch(
        batch, workspace, static_cast<cudaStream_t>(stream));
    if (!status.ok()) return FailStatus(status, error, error_len);
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int64_t detlogp_cuda_h3_projection_forward_workspace_bytes(void) {
  return kTransposeBytes;
}

int detlogp_cuda_h3_projection_forward(const float* x, int64_t rows,
                                       const float* weight, const float* bias,
                                       float* y, void* workspace,
                                       size_t workspace_bytes, int device,
                                       void* stream, char* error,
                                       size_t error_len) {
  try {
    ClearError(error, error_len);
    std::string bad = CheckProjectionRows(rows);
    if (bad.empty()) bad = CheckDevicePointer(weight, "weight", false);
    if (bad.empty()) bad = CheckDevicePointer(bias, "bias", true);
    if (bad.empty()) bad = CheckDevicePointer(workspace, "workspace", false);
    if (bad.empty() && workspace_bytes < static_cast<size_t>(kTransposeBytes)) {
      bad = absl::StrCat("workspace_bytes: need ", kTransposeBytes, ", got ",
                         workspace_bytes);
    }
    if (bad.empty() && rows > 0) bad = CheckDevicePointer(x, "x", false);
    if (bad.empty() && rows > 0) bad = CheckDevicePointer(y, "y", false);
    if (!bad.empty()) return Fail(bad, error, error_len);
    if (rows == 0) return 0;
    auto* weight_t = static_cast<float*>(workspace);
    auto cuda_stream = static_cast<cudaStream_t>(stream);
    absl::Status status = ProjectionCuda::LaunchTransposeWeight(
        weight, weight_t, device, cuda_stream);
    if (!status.ok()) return FailStatus(status, error, error_len);
    auto projection = WrapProjection(weight, weight_t, bias, device);
    if (!projection.ok()) {
      return FailStatus(projection.status(), error, error_len);
    }
    status = (*projection)->Forward(x, rows, y, cuda_stream);
    if (!status.ok()) return FailStatus(status, error, error_len);
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int64_t detlogp_cuda_h3_projection_input_grad_workspace_bytes(int64_t rows) {
  if (rows < 0) return -1;
  return ProjectionCuda::InputGradWorkspaceBytes(rows);
}

int detlogp_cuda_h3_projection_input_grad(const float* dy, int64_t rows,
                                          const float* weight, float* dx,
                                          void* workspace,
                                          size_t workspace_bytes, int device,
                                          void* stream, char* error,
                                          size_t error_len) {
  try {
    ClearError(error, error_len);
    std::string bad = CheckProjectionRows(rows);
    if (bad.empty()) bad = CheckDevicePointer(weight, "weight", false);
    if (bad.empty()) bad = CheckDevicePointer(workspace, "workspace", true);
    const int64_t need = ProjectionCuda::InputGradWorkspaceBytes(rows);
    if (bad.empty() && need > 0 &&
        (workspace == nullptr || workspace_bytes < static_cast<size_t>(need))) {
      bad = absl::StrCat("workspace_bytes: need ", need, " for ", rows,
                         " rows, got ", workspace_bytes);
    }
    if (bad.empty() && rows > 0) bad = CheckDevicePointer(dy, "dy", false);
    if (bad.empty() && rows > 0) bad = CheckDevicePointer(dx, "dx", false);
    if (!bad.empty()) return Fail(bad, error, error_len);
    if (rows == 0) return 0;
    auto projection = WrapProjection(weight, nullptr, nullptr, device);
    if (!projection.ok()) {
      return FailStatus(projection.status(), error, error_len);
    }
    const absl::Status status =
        (*projection)
            ->InputGrad(dy, rows, dx, need > 0 ? workspace : nullptr, need,
                        static_cast<cudaStream_t>(stream));
    if (!status.ok()) return FailStatus(status, error, error_len);
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int64_t detlogp_cuda_h3_projection_weight_grad_workspace_bytes(
    int64_t rows, int64_t first_key) {
  if (rows < 0 || first_key < 0 || first_key > INT64_MAX - rows) return -1;
  return ProjectionCuda::WeightGradWorkspaceBytes(rows, first_key);
}

int detlogp_cuda_h3_projection_weight_grad(
    const float* dy, const float* x, int64_t rows, int64_t first_key,
    float* dweight, float* dbias, void* workspace, size_t workspace_bytes,
    int device, void* stream, char* error, size_t error_len) {
  try {
    ClearError(error, error_len);
    std::string bad = CheckProjectionRows(rows);
    if (bad.empty() && (first_key < 0 || first_key > INT64_MAX - rows)) {
      bad = absl::StrCat("first_key: must be >= 0, got ", first_key);
    }
    if (bad.empty()) bad = CheckDevicePointer(dweight, "dweight", false);
    if (bad.empty()) bad = CheckDevicePointer(dbias, "dbias", true);
    if (bad.empty()) bad = CheckDevicePointer(workspace, "workspace", true);
    if (bad.empty() && rows > 0) bad = CheckDevicePointer(dy, "dy", false);
    if (bad.empty() && rows > 0) bad = CheckDevicePointer(x, "x", false);
    const int64_t need =
        bad.empty() ? ProjectionCuda::WeightGradWorkspaceBytes(rows, first_key)
                    : 0;
    if (bad.empty() && need > 0 &&
        (workspace == nullptr || workspace_bytes < static_cast<size_t>(need))) {
      bad =
          absl::StrCat("workspace_bytes: need ", need, " for ", rows,
                       " rows from key ", first_key, ", got ", workspace_bytes);
    }
    if (!bad.empty()) return Fail(bad, error, error_len);
    // dW/dbias read no weight; any non-null pointer satisfies Create.
    auto projection = WrapProjection(dweight, nullptr, nullptr, device);
    if (!projection.ok()) {
      return FailStatus(projection.status(), error, error_len);
    }
    const absl::Status status =
        (*projection)
            ->WeightGrad(dy, x, rows, first_key, dweight, dbias, workspace,
                         static_cast<int64_t>(workspace_bytes),
                         static_cast<cudaStream_t>(stream));
    if (!status.ok()) return FailStatus(status, error, error_len);
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int detlogp_cuda_determinism_key(const uint16_t* weight,
                                 int64_t padded_vocab_size, int64_t hidden_size,
                                 const float* bias, int64_t vocab_size,
                                 char* key, size_t key_len, char* error,
                                 size_t error_len) {
  try {
    ClearError(error, error_len);
    // server/backends/cuda_backend.cc's description: the architecture, not
    // the device, names the arithmetic.
    detlogp::capi::BackendIdentity cuda;
    cuda.backend = "cuda";
    cuda.instruction_set = detlogp::kernels::cuda::kHopperInstructionSet;
    cuda.kernel_version = LinearLogpCuda::KernelVersion(
        detlogp::kernels::cuda::KernelKind::kHopper);
    return detlogp::capi::WriteDeterminismKey(cuda, weight, padded_vocab_size,
                                              hidden_size, bias, vocab_size,
                                              key, key_len, error, error_len);
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int detlogp_cuda_device_determinism_key(int device, const uint16_t* weight,
                                        int64_t padded_vocab_size,
                                        int64_t hidden_size, const float* bias,
                                        int64_t vocab_size, char* key,
                                        size_t key_len, char* error,
                                        size_t error_len) {
  try {
    ClearError(error, error_len);
    const std::string problem = DeviceProblem(device);
    if (!problem.empty()) return Fail(problem, error, error_len);
    auto kernel = KernelForDevice(device);
    if (!kernel.ok()) return FailStatus(kernel.status(), error, error_len);
    // The same description the server's CUDA backend builds for this GPU.
    auto instruction_set = LinearLogpCuda::InstructionSetOn(*kernel, device);
    if (!instruction_set.ok()) {
      return FailStatus(instruction_set.status(), error, error_len);
    }
    detlogp::capi::BackendIdentity cuda;
    cuda.backend = "cuda";
    cuda.instruction_set = instruction_set->c_str();
    cuda.kernel_version = LinearLogpCuda::KernelVersion(*kernel);
    return detlogp::capi::WriteDeterminismKey(cuda, weight, padded_vocab_size,
                                              hidden_size, bias, vocab_size,
                                              key, key_len, error, error_len);
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int64_t detlogp_cuda_linear_logp_backward_workspace_bytes(
    const detlogp_cuda_lm_head* head, int64_t rows, int bf16_grad_hidden,
    int grad_bias) {
  if (!NoBackward(head).empty() || rows < 1) return -1;
  return static_cast<int64_t>(head->backward->WorkspaceBytes(
      rows, bf16_grad_hidden != 0, grad_bias != 0));
}

int detlogp_cuda_linear_logp_backward(
    const detlogp_cuda_lm_head* head, const void* hidden, int64_t rows,
    const void* targets, int targets_are_int64, const float* temperatures,
    float temperature, const float* lse, const float* entropy,
    const float* grad_logprobs, const float* grad_lse,
    const float* grad_entropy, void* grad_hidden, int grad_hidden_bf16,
    void* grad_weight, int grad_weight_bf16, float* grad_bias, void* workspace,
    size_t workspace_bytes, void* stream, char* error, size_t error_len) {
  try {
    ClearError(error, error_len);
    std::string bad = NoBackward(head);
    if (!bad.empty()) return Fail(bad, error, error_len);
    const LinearLogpGradView view = GradView(
        hidden, rows, targets, targets_are_int64, temperatures, temperature,
        lse, entropy, grad_logprobs, grad_lse, grad_entropy, grad_hidden,
        grad_hidden_bf16, grad_weight, grad_weight_bf16, grad_bias, &bad);
    if (!bad.empty()) return Fail(bad, error, error_len);
    const absl::Status s = head->backward->Launch(
        view, workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
    return s.ok() ? 0 : FailStatus(s, error, error_len);
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

}  // extern "C"
