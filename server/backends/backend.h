// The boundary between the server and compute. The server never knows a
// kernel: it asks a LogpBackend (chosen by name from a BackendRegistry) for
// executors, fills an executor's staging buffers with a batch and runs it.
//
// Contract every backend keeps: a row's logprob and lse bits depend only on
// the row (hidden, target, temperature) and the weights, never on the other
// rows of the batch, the batch size, which executor ran it, or which other
// models the backend holds.
#ifndef DETLOGP_SERVER_BACKENDS_BACKEND_H_
#define DETLOGP_SERVER_BACKENDS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/lm_head.h"
#include "server/backends/backend_registry.h"
#include "server/backends/hidden_location.h"
#include "server/models/lm_head_weights.h"

namespace detlogp::server {

struct BackendDescription {
  std::string name;             // registry name: "cpu", "cuda"
  std::string device;           // human readable, e.g. "cuda:0 NVIDIA H200"
  std::string instruction_set;  // part of the determinism key, e.g. "sm_90a"
  std::string kernel_version;   // changes whenever bits may change
  // Empty when the backend computes entropy and top-k (every backend today);
  // otherwise why not: requests asking for them are refused with
  // FAILED_PRECONDITION naming the field, never answered without them.
  std::string extras_unavailable;
  // Batches a backend wants in flight at once (copies overlap compute).
  int preferred_inflight_batches = 1;
  // Batching defaults that suit the device (DynamicBatcher::Options): the
  // largest batch and how long a row waits for company.
  int64_t preferred_max_batch_rows = 256;
  int64_t preferred_max_queue_delay_micros = 500;
  // How long an idle batch thread polls before sleeping
  // (DynamicBatcher::Options::idle_spin_micros).
  int64_t preferred_idle_spin_micros = 0;
};

// An lm_head placed where a backend's executors read it: host memory for
// the CPU, every GPU's memory for CUDA. Created by LogpBackend::Load; held by
// shared_ptr, so the requests that picked a version keep it alive until they
// are answered.
class LogpModel {
 public:
  virtual ~LogpModel() = default;
  int64_t hidden_size() const { return hidden_size_; }
  int64_t vocab_size() const { return vocab_size_; }
  // Copies bytes [offset, offset + size) of the weights as an upload
  // carries them (the bf16 weight, [padded_vocab_size, hidden_size]
  // row-major, then the fp32 bias, if any) into `out`, from wherever the
  // model holds them (host memory, a GPU's memory): a peer's pull reads a
  // version this way when no host copy is kept. A read of 0 bytes says
  // whether the model can. UNIMPLEMENTED when it cannot (its backend does
  // not read back, or it holds only some of the rows).
  virtual absl::Status ReadWeights(int64_t offset, int64_t size,
                                   char* out) const {
    return absl::UnimplementedError("this backend does not read weights back");
  }

 protected:
  LogpModel(int64_t hidden_size, int64_t vocab_size)
      : hidden_size_(hidden_size), vocab_size_(vocab_size) {}

 private:
  const int64_t hidden_size_;
  const int64_t vocab_size_;
};

// Host buffers for one batch of up to `capacity` rows. Backends may place
// them in pinned memory.
struct LogpStaging {
  int64_t capacity = 0;
  uint16_t* hidden = nullptr;     // bf16 bits, [capacity, H]
  int32_t* targets = nullptr;     // [capacity]
  float* temperatures = nullptr;  // [capacity]
  float* logprobs = nullptr;      // [capacity], written by Run
  float* lse = nullptr;           // [capacity], written by Run
  // Written by Run when the batch asks for them (LogpExtras). The top lists
  // hold capacity * kernels::kMaxTopK elements; Run writes [rows, top_k]
  // row-major with the batch's top_k.
  float* entropy = nullptr;  // [capacity]
  int32_t* top_ids = nullptr;
  float* top_logprobs = nullptr;
};

// What a batch computes beyond logprob and lse: entropy when any of its rows
// asks for it, and the largest top_k any of its rows asks for (a row's top-k
// list for a smaller k is a prefix of it). Rows that asked for less get the
// same bits as if alone: the extras are per-row quantities.
struct LogpExtras {
  bool entropy = false;
  int32_t top_k = 0;  // <= kernels::kMaxTopK; top lists are [rows, top_k]
};

// One batch at a time; each batch thread owns one executor. A batch holds
// rows of one model; consecutive batches may use different models (of any
// shape), all loaded by the executor's backend.
class LogpExecutor {
 public:
  virtual ~LogpExecutor() = default;
  // The staging for a batch of `model`'s rows (grown when a model's rows
  // are wider than any before).
  virtual absl::StatusOr<LogpStaging> Stage(const LogpModel& model) = 0;
  // Says that rows [0, rows) of the staging are final while the batcher
  // gathers the rest, so a device backend can start copying them; the
  // batch's Run follows. Backends that copy in Run ignore it.
  virtual void RowsStaged(int64_t rows) {}
  // Whether this executor copies rows that live at `kind` itself (CopyRows)
  // straight into its device inputs. The batcher gathers kHost rows, and
  // kPinnedHost rows an executor does not take, into the staging; kDevice
  // rows an executor does not take fail their request.
  virtual bool CopiesRowsFrom(HiddenLocation::Kind kind) const { return false; }
  // Rows [staging_row, staging_row + count) of this batch are `count` rows
  // at `rows` (row-major bf16, in memory of `location`, of a kind
  // CopiesRowsFrom accepts): Run copies them, after every staged row, and
  // their staging rows are left unset. `rows` stays valid until Run returns.
  virtual void CopyRows(const HiddenLocation& location, const char* rows,
                        int64_t staging_row, int64_t count) {}
  // Computes rows [0, rows) of the staging buffers on `model` (the one
  // given to Stage), and `extras`, and returns when the outputs are in host
  // memory. A failure fails this batch only.
  virtual absl::Status Run(const LogpModel& model, int64_t rows,
                           const LogpExtras& extras) = 0;
};

class LogpBackend {
 public:
  virtual ~LogpBackend() = default;
  virtual const BackendDescription& description() const = 0;
  // Places `weights` on the backend's devices (every GPU for a replicated
  // CUDA backend) and builds what its executors run. Thread-safe; runs
  // while other models serve.
  virtual absl::StatusOr<std::shared_ptr<const LogpModel>> Load(
      std::shared_ptr<const LmHeadWeights> weights) = 0;
  // Bytes a model of this shape holds once loaded, summed over devices.
  virtual int64_t EstimateBytes(int64_t hidden_size, int64_t padded_vocab_size,
                                bool has_bias) const = 0;
  virtual absl::StatusOr<std::unique_ptr<LogpExecutor>> NewExecutor(
      int64_t max_batch_rows) = 0;
  // Accelerator memory in use by this process's device(s); 0 on the CPU.
  virtual int64_t DeviceMemoryUsedBytes() const { return 0; }

  // Shared-memory regions (server/shared_memory). Registers host memory a
  // client shares so executors copy from it straight to the device;
  // returns whether it did (false: nothing to gain, e.g. on the CPU; the
  // batcher then gathers the rows as usual). A failure is not fatal either.
  virtual bool PinHostMemory(void* data, int64_t bytes) { return false; }
  // Undoes a PinHostMemory that returned true.
  virtual void UnpinHostMemory(void* data) {}
  // Opens another process's device memory (a cudaIpcMemHandle_t's raw
  // bytes) on `device`, which must be one the backend computes on, and
  // checks that `byte_size` bytes from its base lie in one allocation.
  // INVALID_ARGUMENT naming raw_handle, device_id or byte_size when not.
  virtual absl::StatusOr<void*> OpenIpcMemory(const std::string& raw_handle,
                                              int device, int64_t byte_size) {
    return absl::FailedPreconditionError(
        "CUDA shared memory: this server computes on the CPU");
  }
  // Undoes a successful OpenIpcMemory.
  virtual void CloseIpcMemory(void* data, int device) {}
};

// BackendOptions::device_index for "every suitable device" ("cuda:all") and
// for "the first suitable device" ("auto").
inline constexpr int kAllDevices = -1;
inline constexpr int kFirstSuitableDevice = -2;

struct BackendOptions {
  int device_index = 0;
  int cpu_threads = 0;  // 0: one per hardware thread
  // Split the vocabulary over the devices instead of replicating the
  // weights (backends without it ignore it).
  bool vocab_parallel = false;
  // --logp_kernel: which CUDA kernel runs ("auto", "hopper", "portable";
  // empty means auto). Backends with one kernel refuse anything but auto.
  std::string logp_kernel;
};

using LogpBackendRegistry = BackendRegistry<LogpBackend, BackendOptions>;

// Adds the backends this binary was built with (CUDA first when present).
void RegisterBuiltinBackends(LogpBackendRegistry* registry);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_BACKEND_H_
