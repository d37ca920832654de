// One GPU's linear-logp kernels, one after another across the batch
// threads' streams.
//
// Each batch thread has a stream of its own, so a batch's rows are copied
// to the device while an earlier batch computes. The kernels themselves
// each fill every multiprocessor: two at once only share them, and lose
// some of the rate to it (docs/performance.md, "Many workers at once").
// A launch through the sequence waits, on the device, for the kernel
// launched before it on the same GPU; copies are not held back, and the
// host never waits.
#ifndef DETLOGP_SERVER_BACKENDS_CUDA_KERNEL_SEQUENCE_H_
#define DETLOGP_SERVER_BACKENDS_CUDA_KERNEL_SEQUENCE_H_

#include <cuda_runtime_api.h>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace detlogp::server {

class KernelSequence {
 public:
  // Enqueues on `stream`: a wait for the kernel launched last through this
  // sequence, then `launch` (which enqueues the kernel on `stream`), then a
  // record of `done`, the caller's own event, for the next launch to wait
  // for.
  absl::Status Launch(cudaStream_t stream, cudaEvent_t done,
                      absl::FunctionRef<absl::Status()> launch);

  // `done` is about to be destroyed: no later launch waits for it (waits
  // already enqueued keep what they captured).
  void Forget(cudaEvent_t done);

 private:
  absl::Mutex mu_;
  cudaEvent_t last_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_CUDA_KERNEL_SEQUENCE_H_
