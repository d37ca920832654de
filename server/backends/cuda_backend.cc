#include "server/backends/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/linear_logp_cuda.h"
#include "server/backends/cuda_buffers.h"
#include "server/backends/cuda_device_selection.h"
#include "server/backends/cuda_kernel_sequence.h"
#include "server/backends/cuda_lm_head.h"
#include "server/backends/cuda_vocab_parallel.h"

namespace detlogp::server {
namespace {

using kernels::cuda::LinearLogpCuda;

// One batch at a time on its own stream, on the GPU at `slot` of the
// backend's device list. Inputs sit in one pinned block laid out
// [targets | temperatures | hidden] and outputs in [logprobs | lse]; both
// grow when a model's rows are wider than any before.
// Hidden rows start their copy to the device as soon as they are staged, so
// the copy overlaps the gathering of the rest; Run copies what is left
// (targets, temperatures, the last rows) in one go.
class CudaExecutor final : public LogpExecutor {
 public:
  // `kernels`: the sequence of the GPU at `slot`, outliving the executor.
  static absl::StatusOr<std::unique_ptr<CudaExecutor>> Create(
      size_t slot, int device, int64_t capacity, KernelSequence* kernels) {
    // An even capacity keeps the hidden block 16-byte aligned.
    capacity += capacity % 2;
    auto executor = std::unique_ptr<CudaExecutor>(
        new CudaExecutor(slot, device, capacity, kernels));
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaStreamCreateWithFlags(&executor->stream_, cudaStreamNonBlocking),
        "cudaStreamCreate");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaEventCreateWithFlags(&executor->kernel_done_,
                                 cudaEventDisableTiming),
        "cudaEventCreate");
    const size_t output_bytes = executor->layout_.output_bytes();
    if (absl::Status s =
            executor->host_outputs_.Allocate(output_bytes, "cudaHostAlloc");
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            executor->outputs_.Allocate(output_bytes, "cudaMalloc");
        !s.ok()) {
      return s;
    }
    return executor;
  }

  ~CudaExecutor() override {
    if (kernel_done_ != nullptr) {
      kernels_->Forget(kernel_done_);
      cudaEventDestroy(kernel_done_);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::StatusOr<LogpStaging> Stage(const LogpModel& model) override {
    const LinearLogpCuda& kernel = KernelOf(model);
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const size_t input_bytes = layout_.input_bytes(model.hidden_size());
    for (absl::Status s :
         {host_inputs_.Reserve(input_bytes, "cudaHostAlloc"),
          inputs_.Reserve(input_bytes, "cudaMalloc"),
          workspace_.Reserve(kernel.WorkspaceBytes(capacity_), "cudaMalloc")}) {
      if (!s.ok()) return s;
    }
    hidden_size_ = model.hidden_size();
    rows_copied_ = 0;
    return layout_.View(host_inputs_.as<void>(), host_outputs_.as<void>());
  }

  // Rows of registered host memory and of opened CUDA regions go straight
  // from where they are to the device input, after every staged row.
  bool CopiesRowsFrom(HiddenLocation::Kind kind) const override {
    return kind == HiddenLocation::Kind::kPinnedHost ||
           kind == HiddenLocation::Kind::kDevice;
  }

  void CopyRows(const HiddenLocation& location, const char* rows,
                int64_t staging_row, int64_t count) override {
    direct_.push_back(DirectRows{rows, staging_row, count});
  }

  void RowsStaged(int64_t rows) override {
    // Staging rows of direct copies are unset: once a batch has them, its
    // remaining staged rows are copied by Run, around them.
    if (!direct_.empty()) return;
    if (rows > capacity_ ||
        (rows - rows_copied_) * row_bytes() < kMinEarlyCopyBytes) {
      return;
    }
    // Rows whose early copy failed are copied again by Run.
    if (cudaSetDevice(device_) == cudaSuccess &&
        CopyHiddenRows(rows_copied_, rows) == cudaSuccess) {
      rows_copied_ = rows;
    }
  }

  absl::Status Run(const LogpModel& model, int64_t rows,
                   const LogpExtras& extras) override {
    const int64_t rows_copied = std::exchange(rows_copied_, 0);
    const std::vector<DirectRows> direct = std::exchange(direct_, {});
    if (rows > capacity_ || model.hidden_size() != hidden_size_) {
      return absl::InternalError("batch does not match the executor's staging");
    }
    if (rows == 0) return absl::OkStatus();
    const LinearLogpCuda& kernel = KernelOf(model);
    // The extras' partials are larger; the workspace grows on first use.
    if (absl::Status s = workspace_.Reserve(
            kernel.WorkspaceBytes(capacity_, extras.entropy, extras.top_k),
            "cudaMalloc");
        !s.ok()) {
      return s;
    }
    absl::Status enqueued = Enqueue(kernel, rows, rows_copied, direct, extras);
    // Also after a failure: no copy may still read the staging when the
    // batcher refills it.
    const absl::Status done =
        CudaStatus(cudaStreamSynchronize(stream_), "batch on the GPU");
    return enqueued.ok() ? done : enqueued;
  }

 private:
  // Below this, a copy's fixed cost outweighs starting it early.
  static constexpr int64_t kMinEarlyCopyBytes = 128 << 10;

  const LinearLogpCuda& KernelOf(const LogpModel& model) const {
    return *static_cast<const CudaModel&>(model).heads()[slot_]->kernel;
  }

  // Rows CopyRows announced: `count` rows at `source` (registered host or
  // device memory) for staging rows from `staging_row` on.
  struct DirectRows {
    const char* source;
    int64_t staging_row;
    int64_t count;
  };

  // Copies what RowsStaged has not, launches the kernel and copies the
  // outputs back, all on the stream.
  absl::Status Enqueue(const LinearLogpCuda& kernel, int64_t rows,
                       int64_t rows_copied,
                       const std::vector<DirectRows>& direct,
                       const LogpExtras& extras) {
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    if (!direct.empty()) {
      // Targets and temperatures, then the staged rows between the direct
      // ones (in batch order, so RowsStaged copied none after the first),
      // each direct run straight from its memory: the device resolves
      // where it is (unified addressing), peer GPUs included.
      DETLOGP_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(inputs_.as<void>(), host_inputs_.as<void>(),
                          layout_.hidden_offset(), cudaMemcpyHostToDevice,
                          stream_),
          "copy targets to device");
      int64_t next = rows_copied;
      for (const DirectRows& run : direct) {
        if (run.staging_row > next) {
          DETLOGP_RETURN_IF_CUDA_ERROR(CopyHiddenRows(next, run.staging_row),
                                       "copy rows to device");
        }
        DETLOGP_RETURN_IF_CUDA_ERROR(
            cudaMemcpyAsync(inputs_.as<char>() + layout_.hidden_offset() +
                                run.staging_row * row_bytes(),
                            run.source, run.count * row_bytes(),
                            cudaMemcpyDefault, stream_),
            "copy shared-memory rows to device");
        next = run.staging_row + run.count;
      }
      if (next < rows) {
        DETLOGP_RETURN_IF_CUDA_ERROR(CopyHiddenRows(next, rows),
                                     "copy rows to device");
      }
    } else if (rows_copied == 0) {  // one copy for the whole block
      DETLOGP_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(inputs_.as<void>(), host_inputs_.as<void>(),
                          layout_.hidden_offset() + rows * row_bytes(),
                          cudaMemcpyHostToDevice, stream_),
          "copy batch to device");
    } else {
      DETLOGP_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(inputs_.as<void>(), host_inputs_.as<void>(),
                          layout_.hidden_offset(), cudaMemcpyHostToDevice,
                          stream_),
          "copy targets to device");
      if (rows_copied < rows) {
        DETLOGP_RETURN_IF_CUDA_ERROR(CopyHiddenRows(rows_copied, rows),
                                     "copy rows to device");
      }
    }
    const LogpStaging device =
        layout_.View(inputs_.as<void>(), outputs_.as<void>());
    kernels::cuda::LinearLogpBatchView batch;
    batch.targets = device.targets;
    batch.temperatures = device.temperatures;
    batch.hidden = reinterpret_cast<const __nv_bfloat16*>(device.hidden);
    batch.logprobs = device.logprobs;
    batch.lse = device.lse;
    batch.rows = rows;
    batch.entropy = extras.entropy ? device.entropy : nullptr;
    batch.top_k = extras.top_k;
    batch.top_ids = device.top_ids;
    batch.top_logprobs = device.top_logprobs;
    if (absl::Status s = kernels_->Launch(
            stream_, kernel_done_,
            [&] {
              return kernel.Launch(batch, workspace_.as<void>(), stream_);
            });
        !s.ok()) {
      return s;
    }
    return CopyOutputsToHost(layout_, device, host_outputs_.as<void>(), rows,
                             extras, stream_);
  }

  int64_t row_bytes() const { return hidden_size_ * sizeof(uint16_t); }

  cudaError_t CopyHiddenRows(int64_t begin, int64_t end) {
    const size_t offset = layout_.hidden_offset() + begin * row_bytes();
    return cudaMemcpyAsync(
        inputs_.as<char>() + offset, host_inputs_.as<char>() + offset,
        (end - begin) * row_bytes(), cudaMemcpyHostToDevice, stream_);
  }

  CudaExecutor(size_t slot, int device, int64_t capacity,
               KernelSequence* kernels)
      : slot_(slot),
        device_(device),
        capacity_(capacity),
        layout_{capacity},
        kernels_(kernels) {}

  const size_t slot_;
  const int device_;
  const int64_t capacity_;
  const BatchLayout layout_;
  KernelSequence* const kernels_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t kernel_done_ = nullptr;  // recorded after each kernel
  int64_t hidden_size_ = 0;            // of the model last staged
  int64_t rows_copied_ = 0;  // hidden rows of this batch already on their way
  std::vector<DirectRows> direct_;  // this batch's, in staging order
  PinnedBuffer host_inputs_, host_outputs_;
  DeviceBuffer inputs_, outputs_, workspace_;
};

// Bytes of the device allocation holding `data`, from `data` to its end
// (the driver's cuMemGetAddressRange).
absl::StatusOr<int64_t> AllocationBytesFrom(const void* data) {
  using GetAddressRange = int (*)(unsigned long long* base, size_t* size,
                                  unsigned long long pointer);
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &entry, 12000,
                                       cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || entry == nullptr) {
    cudaGetLastError();
    return absl::InternalError("cuMemGetAddressRange is not available");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const unsigned long long pointer = reinterpret_cast<uintptr_t>(data);
  if (reinterpret_cast<GetAddressRange>(entry)(&base, &size, pointer) != 0) {
    return absl::InvalidArgumentError(
        "raw_handle: the driver knows no allocation at the opened address");
  }
  return static_cast<int64_t>(base + size - pointer);
}

// Drives one GPU ("cuda:N", or the first suitable one for "auto") or every
// GPU of one kind ("cuda:all"); which ones and which kernel is
// SelectGpus' rule (cuda_device_selection.h): the Hopper kernel on compute
// capability 9.0, the portable kernel on any other >= 8.0, or the one
// --logp_kernel forces. Replicated (the default), each GPU holds the full
// weights; executors are spread over the GPUs and every batch thread pulls
// from the one queue when its executor is free, so batches go to whichever
// GPU is least loaded. With vocab_parallel each GPU holds a share of the
// vocabulary instead (cuda_vocab_parallel.h). GPUs of one kind run the same
// kernel build, hence the same bits: the determinism key names the kernel
// and its instruction set, not the device index.
class CudaBackend final : public LogpBackend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(
      const BackendOptions& options) {
    auto choice = ParseLogpKernelChoice(options.logp_kernel);
    if (!choice.ok()) return choice.status();
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();  // clear the sticky "no device" error
      return absl::UnavailableError("no CUDA device on this machine");
    }
    std::vector<GpuInfo> visible;
    for (int device = 0; device < count; ++device) {
      cudaDeviceProp props;
      DETLOGP_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&props, device),
                                   "cudaGetDeviceProperties");
      visible.push_back(GpuInfo{device, props.name, props.major, props.minor});
    }
    auto selection = SelectGpus(visible, options.device_index,
                                options.vocab_parallel, *choice);
    if (!selection.ok()) return selection.status();
    // Every selected GPU is of one kind, so one instruction set names them
    // all; each is still asked (each loads the kernel's code).
    std::string instruction_set;
    for (int device : selection->devices) {
      auto isa = LinearLogpCuda::InstructionSetOn(selection->kernel, device);
      if (!isa.ok()) return isa.status();
      if (!instruction_set.empty() && *isa != instruction_set) {
        return absl::InternalError(absl::StrCat(
            "GPUs of one kind report different code: ", instruction_set, " vs ",
            *isa, " on cuda:", device));
      }
      instruction_set = *std::move(isa);
    }
    auto backend = std::unique_ptr<CudaBackend>(new CudaBackend());
    const std::vector<int>& used = selection->devices;
    backend->devices_ = used;
    for (size_t slot = 0; slot < used.size(); ++slot) {
      backend->kernel_sequences_.push_back(std::make_unique<KernelSequence>());
    }
    backend->kernel_ = selection->kernel;
    backend->vocab_parallel_ = options.vocab_parallel;
    backend->description_.name = "cuda";
    backend->description_.device = absl::StrCat(
        "cuda:", absl::StrJoin(used, ","), " ", selection->name,
        options.vocab_parallel ? " (vocabulary-parallel)" : "",
        selection->left_out.empty()
            ? ""
            : absl::StrCat(" (left idle, another kind: ",
                           absl::StrJoin(selection->left_out, ", "), ")"));
    backend->description_.instruction_set = instruction_set;
    backend->description_.kernel_version =
        LinearLogpCuda::KernelVersion(selection->kernel);
    backend->description_.preferred_inflight_batches =
        options.vocab_parallel ? 4 : 4 * static_cast<int>(used.size());
    // A batch of small calls takes ~0.35 ms; a sleeping batch thread took
    // 40-70 us to wake (docs/architecture.md, "Batching").
    backend->description_.preferred_idle_spin_micros = 1000;
    // One batch streams the whole weight (0.3 ms at N <= 190); large batches
    // and no waiting gave 490-507k rows/s and the lowest small-call latency
    // (docs/performance.md, "Serving end to end").
    backend->description_.preferred_max_batch_rows = 4096;
    backend->description_.preferred_max_queue_delay_micros = 0;
    return backend;
  }

  const BackendDescription& description() const override {
    return description_;
  }

  absl::StatusOr<std::shared_ptr<const LogpModel>> Load(
      std::shared_ptr<const LmHeadWeights> weights) override {
    if (weights == nullptr)
      return absl::InvalidArgumentError("cuda backend: no weights");
    std::vector<std::unique_ptr<CudaLmHead>> heads;
    if (vocab_parallel_) {
      auto shards = UploadVocabShards(*weights, devices_, kernel_);
      if (!shards.ok()) return shards.status();
      heads = *std::move(shards);
    } else {
      for (int device : devices_) {
        auto replica = UploadLmHead(*weights, device, kernel_);
        if (!replica.ok()) return replica.status();
        heads.push_back(*std::move(replica));
      }
    }
    // The host copy is not kept: the caller's reference is the last one.
    return std::make_shared<const CudaModel>(
        weights->hidden_size, weights->vocab_size, std::move(heads),
        weights->padded_vocab_size, !weights->bias.empty());
  }

  int64_t EstimateBytes(int64_t hidden_size, int64_t padded_vocab_size,
                        bool has_bias) const override {
    const int64_t bytes =
        padded_vocab_size * (hidden_size * 2 + (has_bias ? 4 : 0));
    return vocab_parallel_ ? bytes
                           : bytes * static_cast<int64_t>(devices_.size());
  }

  int64_t DeviceMemoryUsedBytes() const override {
    int64_t used = 0;
    for (int device : devices_) {
      size_t free_bytes = 0, total_bytes = 0;
      if (cudaSetDevice(device) == cudaSuccess &&
          cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
        used += static_cast<int64_t>(total_bytes - free_bytes);
      }
    }
    return used;
  }

  // Portable: every GPU (and every executor's stream) copies from it.
  // Read-only: the mapping is; drivers that cannot pin such pages refuse,
  // and the batcher then gathers those rows through the staging.
  bool PinHostMemory(void* data, int64_t bytes) override {
    if (cudaSetDevice(devices_.front()) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    const cudaError_t pinned =
        cudaHostRegister(data, static_cast<size_t>(bytes),
                         cudaHostRegisterPortable | cudaHostRegisterReadOnly);
    if (pinned != cudaSuccess) {
      cudaGetLastError();  // not sticky; clear it for the next call
      return false;
    }
    return true;
  }

  void UnpinHostMemory(void* data) override {
    if (cudaSetDevice(devices_.front()) == cudaSuccess) {
      cudaHostUnregister(data);
    }
    cudaGetLastError();
  }

  absl::StatusOr<void*> OpenIpcMemory(const std::string& raw_handle, int device,
                                      int64_t byte_size) override {
    if (vocab_parallel_) {
      return absl::FailedPreconditionError(
          "CUDA shared memory: not read by the vocabulary-parallel backend "
          "(--vocab_parallel); use a system region");
    }
    if (std::find(devices_.begin(), devices_.end(), device) == devices_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_id: cuda:", device,
                       " is not a GPU this server computes on (cuda:",
                       absl::StrJoin(devices_, ","), ")"));
    }
    cudaIpcMemHandle_t handle;
    if (raw_handle.size() != sizeof(handle)) {
      return absl::InvalidArgumentError(
          absl::StrCat("raw_handle: ", raw_handle.size(),
                       " bytes, a cudaIpcMemHandle_t has ", sizeof(handle)));
    }
    std::memcpy(&handle, raw_handle.data(), sizeof(handle));
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
    void* data = nullptr;
    const cudaError_t opened =
        cudaIpcOpenMemHandle(&data, handle, cudaIpcMemLazyEnablePeerAccess);
    if (opened != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          "raw_handle: cudaIpcOpenMemHandle on cuda:", device,
          " failed: ", cudaGetErrorString(opened),
          " (a handle of another process, for memory on this GPU?)"));
    }
    // Copies may not read past the allocation: its extent comes from the
    // driver (resolved through the runtime, so no link to libcuda).
    auto extent = AllocationBytesFrom(data);
    if (!extent.ok() || *extent < byte_size) {
      cudaIpcCloseMemHandle(data);
      if (!extent.ok()) return extent.status();
      return absl::InvalidArgumentError(
          absl::StrCat("byte_size: ", byte_size,
                       " bytes, but the allocation "
                       "holds ",
                       *extent, " from the handle's base"));
    }
    return data;
  }

  void CloseIpcMemory(void* data, int device) override {
    if (cudaSetDevice(device) == cudaSuccess) cudaIpcCloseMemHandle(data);
    cudaGetLastError();
  }

  absl::StatusOr<std::unique_ptr<LogpExecutor>> NewExecutor(
      int64_t max_batch_rows) override {
    if (vocab_parallel_)
      return NewVocabParallelExecutor(devices_, max_batch_rows);
    const size_t slot = next_slot_++ % devices_.size();
    auto executor = CudaExecutor::Create(slot, devices_[slot], max_batch_rows,
                                         kernel_sequences_[slot].get());
    if (!executor.ok()) return executor.status();
    return std::unique_ptr<LogpExecutor>(*std::move(executor));
  }

 private:
  CudaBackend() = default;

  std::vector<int> devices_;
  kernels::cuda::KernelKind kernel_ = kernels::cuda::KernelKind::kHopper;
  bool vocab_parallel_ = false;
  size_t next_slot_ = 0;
  // One a GPU, by slot: its kernels run one at a time.
  std::vector<std::unique_ptr<KernelSequence>> kernel_sequences_;
  BackendDescription description_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LogpBackend>> CreateCudaBackend(
    const BackendOptions& options) {
  auto backend = CudaBackend::Create(options);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<LogpBackend>(*std::move(backend));
}

}  // namespace detlogp::server
