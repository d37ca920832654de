// Host API of the batch-invariant fused linear + log-softmax gather on CUDA:
// the Hopper kernel (sm_90a) and the portable kernel (any GPU of compute
// capability >= 8.0), see KernelKind (kernel_kind.h).
//
// For each row r of a batch:
//   z[v]   = (hidden[r] . weight[v] + bias[v]) / temperature[r],  v < V
//   lse[r] = logsumexp_v z[v]
//   logprob[r] = z[targets[r]] - lse[r]
// with bf16 inputs, fp32 accumulation and fp32 outputs; the [N, V] logits are
// never written to memory.
//
// Determinism: in SplitMode::kBatchInvariant a row's output bits depend only on
// its hidden vector, target and temperature and on the weights; never on the
// batch size, the row's position, its neighbours, the stream or timing. The
// vocabulary is cut by kernels/split_policy.h (a function of V alone) and the
// per-split partials are folded in ascending split order. KernelVersion()
// changes whenever the bits a given input produces may change.
//
// Build: two translation units with unambiguous code. linear_logp_cuda.cu
// (this launcher, the Hopper kernel and its combine) is sm_90a only;
// linear_logp_portable.cu (the portable kernel and its own combine) holds
// sm_80/86/89/90 machine code and compute_80 PTX. kHopper needs a device of
// compute capability 9.0 (H100/H200); kPortable any of >= 8.0 (newer GPUs
// such as sm_100/sm_120 run its PTX through the driver's JIT). No libcuda
// link is needed (the tensor-map encoder is fetched through
// cudaGetDriverEntryPointByVersion).
#ifndef DETLOGP_KERNELS_CUDA_LINEAR_LOGP_CUDA_H_
#define DETLOGP_KERNELS_CUDA_LINEAR_LOGP_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/kernel_kind.h"

namespace detlogp::kernels::cuda {

// Device pointers to the model's output head; they must outlive the
// LinearLogpCuda built on them.
struct LinearLogpWeightsView {
  const __nv_bfloat16* weight = nullptr;  // [padded_vocab_size, hidden_size],
                                          // row-major, 16-byte aligned
  const float* bias = nullptr;            // [padded_vocab_size] or null,
                                          // 8-byte aligned
  int64_t hidden_size = 0;        // H: a multiple of 64, 64 <= H <= 65536
  int64_t vocab_size = 0;         // V: real vocabulary, rows >= V never count
  int64_t padded_vocab_size = 0;  // Vpad >= V: rows stored in `weight`
};

// Device pointers for one batch. Temperatures must be finite and > 0 (the
// server validates them and the targets on the host). Launch gives a row
// whose target lies outside [0, V) a NaN logprob (its lse is still exact).
struct LinearLogpBatchView {
  const __nv_bfloat16* hidden = nullptr;  // [rows, hidden_size], 16-B aligned
  const int32_t* targets = nullptr;       // [rows], or null: targets64
  const float* temperatures = nullptr;    // [rows], or null: temperature
  float* logprobs = nullptr;              // [rows] out
  float* lse = nullptr;                   // [rows] out
  int64_t rows = 0;
  // Optional outputs (kernels/lm_head.h has the definitions). They never
  // change logprobs or lse bits; a batch without them runs the same kernel
  // as before they existed.
  float* entropy = nullptr;       // [rows] out, or null: not computed
  int32_t top_k = 0;              // 0..min(kMaxTopK, V), the same for all rows
  int32_t* top_ids = nullptr;     // [rows, top_k] out, descending
  float* top_logprobs = nullptr;  // [rows, top_k] out: z - lse
  // Read in place instead of a converted copy (a trainer's int64 token ids;
  // kernels/capi): used only when targets is null. 8-byte aligned.
  const int64_t* targets64 = nullptr;  // [rows]
  // Every row's temperature when temperatures is null (the same bits as a
  // [rows] array holding it).
  float temperature = 1.0f;
};

// Per-(row, split) partial states in device memory: a view of a workspace
// (LinearLogpCuda::PartitionWorkspace) or of a vocabulary-parallel gather.
struct SplitPartials {
  float* lse = nullptr;        // [rows][splits]: each split's logsumexp
  float* mean_z = nullptr;     // [rows][splits]: sum p z over the split
                               // (entropy only)
  float* top_z = nullptr;      // [rows][splits][top_k] (top-k only)
  int32_t* top_ids = nullptr;  // [rows][splits][top_k], global token ids
  // [rows][epilogue::kScreenWords] keys, 16-byte aligned (top-k only,
  // optional): what a row's splits share to skip values another split has
  // already ruled out; cleared by LaunchSplits. Null: every split screens
  // alone (same results, slower).
  uint32_t* top_screen = nullptr;
  // [row blocks of 128 + 1] (top-k, Launch on the Hopper kernel): which row
  // blocks a speculative floor left short, so that they run again
  // (linear_logp_floor_kernel.cuh). Null: no floors.
  int32_t* rerun_blocks = nullptr;
};

// Which split-pass kernel a LinearLogpCuda runs: KernelKind (kernel_kind.h).
// Both follow the same contract (split policy, partial format, combine);
// their bits differ, so each has its own kernel version. Both compute
// entropy and top-k (the same epilogue code, linear_logp_epilogue.cuh).

enum class SplitMode {
  kBatchInvariant,  // the product: split_policy.h, bits independent of N
  kThroughput,      // benchmarks only: splits tuned to N and the SM count;
                    // results depend on N (NOT batch-invariant)
};

// One per device and set of weights. Thread-compatible: Launch is const and may
// be called concurrently from several host threads on different streams, each
// with its own workspace and outputs.
class LinearLogpCuda {
 public:
  struct Options {
    LinearLogpWeightsView weights;
    int device = 0;
    SplitMode split = SplitMode::kBatchInvariant;
    KernelKind kernel = KernelKind::kHopper;
    // Vocabulary-parallel shard (end_split > 0): this object holds only the
    // weight rows of splits [first_split, end_split) of the policy for
    // weights.vocab_size (the full V). weights.weight and weights.bias then
    // point at row ShardBegin(), and weights.padded_vocab_size counts the
    // shard's rows. Only LaunchSplits may be used; every split is computed
    // exactly as in the unsharded kernel, so folding all shards' partials in
    // ascending split order (LaunchCombine) gives the unsharded bits.
    int32_t first_split = 0;
    int32_t end_split = 0;
    // The item order of both kernels (kernels/item_order.h): row blocks
    // whose items run together, for launches without top-k and with it;
    // 0: kDefaultRowGroup / kDefaultTopKRowGroup. A tuning knob: it never
    // changes bits.
    int32_t row_group = 0;
    int32_t top_k_row_group = 0;
    // Launch with top-k on the Hopper kernel seeds each row's screen with a
    // speculative floor, mean + sigmas * deviation of a column sample's z,
    // and runs the row blocks a floor left short again
    // (linear_logp_floor_kernel.cuh). A speed knob: never changes bits.
    // The sample's weight rows live in the object: 512 x H bytes (2 MiB at
    // H = 4096), plus 1 KiB of bias.
    // top_k_floor_sigmas > 0 replaces the sigmas chosen from k and V (tests
    // force reruns with it). Batches of fewer than top_k_floor_min_rows rows
    // get none: at N <= 256 the floor kernel and the rerun pass cost more
    // than the floors save (docs/kernels.md, "Top-k floors").
    bool top_k_floors = true;
    float top_k_floor_sigmas = 0.0f;
    int64_t top_k_floor_min_rows = 512;
  };

  // Validates the weights view and the device (kHopper: compute capability
  // 9.0 with the sm_90a kernel present, and builds the weight tensor map;
  // kPortable: >= 8.0 with code this build ships or the driver can JIT).
  static absl::StatusOr<std::unique_ptr<LinearLogpCuda>> Create(
      const Options& options);

  ~LinearLogpCuda();
  LinearLogpCuda(const LinearLogpCuda&) = delete;
  LinearLogpCuda& operator=(const LinearLogpCuda&) = delete;

  // Device workspace a batch of `rows` needs: 4 bytes per row and split
  // (528 bytes per row at V = 151936; at most 1 KiB per row), 4 more with
  // entropy and 8 * top_k more with top-k, plus the rows' shared top-k
  // screens (272 bytes per row) and the floors' rerun marks (4 bytes per
  // 128 rows). Needs 4-byte alignment.
  size_t WorkspaceBytes(int64_t rows, bool entropy = false,
                        int32_t top_k = 0) const;

  // Bytes PartitionWorkspace lays out for `rows` rows and `splits` splits.
  static size_t PartialsBytes(int64_t rows, int32_t splits, bool entropy,
                              int32_t top_k);
  // A row's top_screen bytes (SplitPartials), 16-byte aligned.
  static constexpr size_t kTopKScreenRowBytes = 272;

  // Cuts a workspace of PartialsBytes(rows, splits, entropy, top_k) bytes
  // (WorkspaceBytes(rows, entropy, top_k) holds it) into the partials of
  // `splits` splits (NumSplits(rows) here; the whole policy's count for a
  // vocabulary-parallel gather).
  static SplitPartials PartitionWorkspace(void* workspace, int64_t rows,
                                          int32_t splits, bool entropy,
                                          int32_t top_k);

  // Enqueues the computation on `stream` (on options.device). Validates the
  // shapes and pointers, never synchronizes the host. `workspace` must hold
  // WorkspaceBytes(rows) bytes and must not be used concurrently by another
  // launch. rows == 0 is a no-op.
  absl::Status Launch(const LinearLogpBatchView& batch, void* workspace,
                      cudaStream_t stream) const;

  // Number of vocabulary splits used for a batch of `rows` rows (a function of
  // V alone in kBatchInvariant mode; a shard's own count for a shard).
  int32_t NumSplits(int64_t rows) const;

  // The split pass alone: each split's partials into `partials`
  // ([rows][NumSplits(rows)]; mean_z when partials.mean_z is set, the top
  // lists when batch.top_k > 0) and, for rows whose target lies in this
  // object's rows, z[target] into batch.logprobs (other rows' logprobs are
  // left untouched). For a shard, batch.targets hold target - ShardBegin();
  // top-k ids are global.
  absl::Status LaunchSplits(const LinearLogpBatchView& batch,
                            const SplitPartials& partials,
                            cudaStream_t stream) const;

  // Folds rows' split partials in ascending split order and finishes
  // logprob = z[target] - lse (logprobs holds z on entry), entropy when
  // outputs.entropy is set and the top lists when outputs.top_k > 0, on
  // `device`. Only the output fields and rows of `outputs` are used.
  // `kernel` picks the combine built with that kernel's split pass (the same
  // source, compiled in the same translation unit for the same
  // architectures): pass the kind of the objects that wrote the partials.
  static absl::Status LaunchCombine(const SplitPartials& partials,
                                    int32_t num_splits,
                                    const LinearLogpBatchView& outputs,
                                    int device, cudaStream_t stream,
                                    KernelKind kernel = KernelKind::kHopper);

  // First vocabulary row held (0 unless a shard).
  int64_t ShardBegin() const;
  bool is_shard() const { return options_.end_split > 0; }

  // Identifies the arithmetic: changes whenever bits may change. The
  // no-argument form is the Hopper kernel's (kept for existing callers).
  static const char* KernelVersion();
  static const char* KernelVersion(KernelKind kernel);
  // This object's kernel version: KernelVersion(options().kernel).
  const char* kernel_version() const;
  // What the bits depend on besides the kernel version, for the
  // determinism key: kHopperInstructionSet ("sm_90a") for the Hopper kernel
  // (its existing key), and PortableInstructionSet(...) for the portable
  // kernel: the device's compute capability and the cubin the driver loaded,
  // or, when the driver JIT-compiled the PTX, the PTX's architecture and the
  // driver's version (kernel_kind.h).
  std::string instruction_set() const;
  // The instruction set a LinearLogpCuda of `kernel` would report on
  // `device`, without weights (loads the kernel's code, so an error when the
  // build has none the device can run).
  static absl::StatusOr<std::string> InstructionSetOn(KernelKind kernel,
                                                      int device);

  const Options& options() const { return options_; }

 private:
  // Fills begin[0..n] with the boundaries of the n splits a batch of `rows`
  // uses (the policy's table in batch-invariant mode) and returns n.
  int32_t SplitTable(int64_t rows, int32_t* begin) const;
  struct Impl;
  LinearLogpCuda(const Options& options, std::unique_ptr<Impl> impl);
  // Create's and LaunchSplits' kPortable paths.
  static absl::StatusOr<std::unique_ptr<LinearLogpCuda>> CreatePortable(
      const Options& options, const cudaDeviceProp& prop, int32_t all_splits,
      bool shard, int64_t held_begin);
  absl::Status LaunchPortableSplits(const LinearLogpBatchView& batch,
                                    const SplitPartials& partials,
                                    cudaStream_t stream) const;
  // LaunchSplits' body. floor_sigmas > 0: the screens start at speculative
  // floors instead of cleared; rerun_blocks set: a rerun pass over the
  // marked row blocks, the screens as the combine left them.
  absl::Status LaunchSplitPass(const LinearLogpBatchView& batch,
                               const SplitPartials& partials,
                               cudaStream_t stream, float floor_sigmas,
                               const int32_t* rerun_blocks) const;
  // The sigmas of Launch's floors, or 0: no floors for this batch.
  float FloorSigmas(const LinearLogpBatchView& batch,
                    const SplitPartials& partials) const;

  Options options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detlogp::kernels::cuda

#endif  // DETLOGP_KERNELS_CUDA_LINEAR_LOGP_CUDA_H_
