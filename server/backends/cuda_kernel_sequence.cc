#include "server/backends/cuda_kernel_sequence.h"

#include "server/backends/cuda_buffers.h"

namespace detlogp::server {

absl::Status KernelSequence::Launch(cudaStream_t stream, cudaEvent_t done,
                                    absl::FunctionRef<absl::Status()> launch) {
  absl::MutexLock lock(&mu_);
  // The caller's own last kernel is ordered by its stream already.
  if (last_ != nullptr && last_ != done) {
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, last_, 0),
                                 "wait for the GPU's previous kernel");
  }
  if (absl::Status launched = launch(); !launched.ok()) return launched;
  DETLOGP_RETURN_IF_CUDA_ERROR(cudaEventRecord(done, stream),
                               "record the kernel's end");
  last_ = done;
  return absl::OkStatus();
}

void KernelSequence::Forget(cudaEvent_t done) {
  absl::MutexLock lock(&mu_);
  if (last_ == done) last_ = nullptr;
}

}  // namespace detlogp::server
