// The boundary between the server and compute. The server never knows a
// kernel: it asks a LogpBackend (chosen by name from a BackendRegistry) for
// executors, fills an executor's staging buffers with a batch and runs it.
//
// Contract every backend keeps: a row's logprob and lse bits depend only on
// the row (hidden, target, temperature) and the weights, never on the other
// rows of the batch, the batch size or which executor ran it.
#ifndef DETLOGP_SERVER_BACKENDS_BACKEND_H_
#define DETLOGP_SERVER_BACKENDS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backends/backend_registry.h"
#include "server/models/lm_head_weights.h"

namespace detlogp::server {

struct BackendDescription {
  std::string name;             // registry name: "cpu", "cuda"
  std::string device;           // human readable, e.g. "cuda:0 NVIDIA H200"
  std::string instruction_set;  // part of the determinism key, e.g. "sm_90a"
  std::string kernel_version;   // changes whenever bits may change
  // Batches a backend wants in flight at once (copies overlap compute).
  int preferred_inflight_batches = 1;
  // How long an idle batch thread polls before sleeping
  // (DynamicBatcher::Options::idle_spin_micros).
  int64_t preferred_idle_spin_micros = 0;
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
};

// One batch at a time; each batch thread owns one executor.
class LogpExecutor {
 public:
  virtual ~LogpExecutor() = default;
  virtual LogpStaging staging() = 0;
  // Says that rows [0, rows) of the staging are final while the batcher
  // gathers the rest, so a device backend can start copying them; the
  // batch's Run follows. Backends that copy in Run ignore it.
  virtual void RowsStaged(int64_t rows) {}
  // Computes rows [0, rows) of the staging buffers and returns when the
  // outputs are in host memory. A failure fails this batch only.
  virtual absl::Status Run(int64_t rows) = 0;
};

class LogpBackend {
 public:
  virtual ~LogpBackend() = default;
  virtual const BackendDescription& description() const = 0;
  virtual absl::StatusOr<std::unique_ptr<LogpExecutor>> NewExecutor(
      int64_t max_batch_rows) = 0;
  // Accelerator memory in use by this process's device(s); 0 on the CPU.
  virtual int64_t DeviceMemoryUsedBytes() const { return 0; }
};

// BackendOptions::device_index for "every suitable device" ("cuda:all") and
// for "the first suitable device" ("auto").
inline constexpr int kAllDevices = -1;
inline constexpr int kFirstSuitableDevice = -2;

struct BackendOptions {
  // Outlives the backend.
  const LmHeadWeights* weights = nullptr;
  int device_index = 0;
  int cpu_threads = 0;  // 0: one per hardware thread
  // Split the vocabulary over the devices instead of replicating the
  // weights (backends without it ignore it).
  bool vocab_parallel = false;
};

using LogpBackendRegistry = BackendRegistry<LogpBackend, BackendOptions>;

// Adds the backends this binary was built with (CUDA first when present).
void RegisterBuiltinBackends(LogpBackendRegistry* registry);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_BACKEND_H_
