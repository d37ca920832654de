// C ABI over LinearLogpCuda for tools/device/logp_bench.py (ctypes). Benchmark
// use only: no timing here, the caller times with CUDA events.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "kernels/cuda/linear_logp_cuda.h"

using detlogp::kernels::cuda::LinearLogpBatchView;
using detlogp::kernels::cuda::LinearLogpCuda;
using detlogp::kernels::cuda::SplitMode;

extern "C" {

// mode: 0 = batch-invariant, 1 = throughput split, 2 = batch-invariant on the
// portable mma.sync kernel. Returns null on error (printed to
// stderr).
// logp_create with the kernels' item order set (LinearLogpCuda::
// Options::row_group and top_k_row_group; 0: the default).
void* logp_create_tuned(const void* weight, const float* bias, long long hidden,
                        long long vocab, long long padded_vocab, int mode,
                        int device, int row_group, int top_k_row_group);

void* logp_create(const void* weight, const float* bias, long long hidden,
                  long long vocab, long long padded_vocab, int mode,
                  int device) {
  return logp_create_tuned(weight, bias, hidden, vocab, padded_vocab, mode,
                           device, 0, 0);
}

void* logp_create_tuned(const void* weight, const float* bias, long long hidden,
                        long long vocab, long long padded_vocab, int mode,
                        int device, int row_group, int top_k_row_group) {
  LinearLogpCuda::Options o;
  o.row_group = row_group;
  o.top_k_row_group = top_k_row_group;
  // Top-k floors (Options::top_k_floors) off with DETLOGP_TOP_K_FLOORS=0;
  // DETLOGP_TOP_K_FLOOR_SIGMAS sets their sigmas (benches only).
  if (const char* f = std::getenv("DETLOGP_TOP_K_FLOORS")) {
    o.top_k_floors = std::strcmp(f, "0") != 0;
  }
  if (const char* f = std::getenv("DETLOGP_TOP_K_FLOOR_SIGMAS")) {
    o.top_k_floor_sigmas = std::strtof(f, nullptr);
  }
  o.weights.weight = static_cast<const __nv_bfloat16*>(weight);
  o.weights.bias = bias;
  o.weights.hidden_size = hidden;
  o.weights.vocab_size = vocab;
  o.weights.padded_vocab_size = padded_vocab;
  o.device = device;
  o.split = mode == 1 ? SplitMode::kThroughput : SplitMode::kBatchInvariant;
  if (mode == 2) o.kernel = detlogp::kernels::cuda::KernelKind::kPortable;
  auto k = LinearLogpCuda::Create(o);
  if (!k.ok()) {
    std::fprintf(stderr, "logp_create: %s\n", k.status().ToString().c_str());
    return nullptr;
  }
  return k->release();
}

void logp_destroy(void* h) { delete static_cast<LinearLogpCuda*>(h); }

unsigned long long logp_workspace_bytes(void* h, long long rows) {
  return static_cast<LinearLogpCuda*>(h)->WorkspaceBytes(rows);
}

int logp_num_splits(void* h, long long rows) {
  return static_cast<LinearLogpCuda*>(h)->NumSplits(rows);
}

const char* logp_version() { return LinearLogpCuda::KernelVersion(); }

unsigned long long logp_workspace_bytes_extras(void* h, long long rows,
                                               int entropy, int top_k) {
  return static_cast<LinearLogpCuda*>(h)->WorkspaceBytes(rows, entropy != 0,
                                                         top_k);
}

// logp_launch with entropy (null: none) and top-k (top_k = 0: none).
int logp_launch_extras(void* h, const void* hidden, const int* targets,
                       const float* temps, float* logprobs, float* lse,
                       float* entropy, int top_k, int* top_ids,
                       float* top_logprobs, long long rows, void* workspace,
                       void* stream) {
  LinearLogpBatchView b{static_cast<const __nv_bfloat16*>(hidden),
                        targets,
                        temps,
                        logprobs,
                        lse,
                        rows};
  b.entropy = entropy;
  b.top_k = top_k;
  b.top_ids = top_ids;
  b.top_logprobs = top_logprobs;
  const absl::Status s = static_cast<LinearLogpCuda*>(h)->Launch(
      b, workspace, static_cast<cudaStream_t>(stream));
  if (!s.ok()) {
    std::fprintf(stderr, "logp_launch_extras: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

// Returns 0 on success, 1 on error (printed).
int logp_launch(void* h, const void* hidden, const int* targets,
                const float* temps, float* logprobs, float* lse, long long rows,
                void* workspace, void* stream) {
  return logp_launch_extras(h, hidden, targets, temps, logprobs, lse, nullptr,
                            0, nullptr, nullptr, rows, workspace, stream);
}

}  // extern "C"
