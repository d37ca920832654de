// Launcher for the fused linear-logp kernels: Hopper v3
// (linear_logp_kernel.cuh, compiled here for sm_90a with its combine) and the
// portable mma.sync kernel (reached through linear_logp_portable.h: its code
// lives in linear_logp_portable.cu, built for sm_80..sm_90 + compute_80 PTX).
#include "kernels/cuda/linear_logp_cuda.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_host.h"
#include "kernels/cuda/linear_logp_combine_kernel.cuh"
#include "kernels/cuda/linear_logp_floor_kernel.cuh"
#include "kernels/cuda/linear_logp_kernel.cuh"
#include "kernels/cuda/linear_logp_portable.h"
#include "kernels/lm_head.h"
#include "kernels/softmax_partial.h"
#include "kernels/split_policy.h"

namespace detlogp::kernels::cuda {
namespace {

namespace kv = ::detlogp::kernels::cuda::v3;
namespace kp = ::detlogp::kernels::cuda::portable_v1;

static_assert(kp::kMaxTopK == kv::kMaxTopK, "one top-k limit for both");
static_assert(kp::kMaxSplits == kv::kMaxSplits,
              "both kernels take the same split tables and partials");

static_assert(kv::kMaxTopK == kMaxTopK,
              "the kernel's top-k lists hold kernels::kMaxTopK entries");

constexpr int64_t kMaxRows = int64_t{1} << 24;
constexpr int64_t kMaxHidden = 65536;
constexpr int64_t kMaxVocab = (int64_t{1} << 31) - 1024;

constexpr char kCudaComponent[] = "linear_logp_cuda";
// The rows' shared top-k screens (linear_logp_topk.cuh).
constexpr size_t kScreenAlign = 16;
constexpr size_t kScreenRowBytes = LinearLogpCuda::kTopKScreenRowBytes;
static_assert(kScreenRowBytes == sizeof(uint32_t) * epilogue::kScreenWords,
              "the header's screen size is the kernels'");

// Throughput-tuned split (benchmarks only): splits of whole 256-wide tiles,
// their count chosen to balance (row blocks x splits) items over the SMs.
int32_t ThroughputSplits(int64_t rows, int64_t vocab, int num_sms,
                         int32_t* begin) {
  const int64_t row_blocks = (rows + kv::kBlockM - 1) / kv::kBlockM;
  const int64_t tiles = (vocab + kv::kBlockN - 1) / kv::kBlockN;
  const int64_t max_splits = std::min<int64_t>(
      tiles, std::min<int64_t>(kv::kMaxSplits, NumVocabSplits(vocab)));
  int64_t best = 1;
  double best_cost = std::numeric_limits<double>::infinity();
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t items = row_blocks * s;
    const int64_t waves = (items + num_sms - 1) / num_sms;
    const int64_t per_item = (tiles + s - 1) / s;
    // 0.05 tile of fixed cost per item (pipeline turn-around, partial write).
    const double cost = static_cast<double>(waves) * (per_item + 0.05);
    if (cost < best_cost - 1e-9) {
      best_cost = cost;
      best = s;
    }
  }
  for (int64_t s = 0; s <= best; ++s) {
    const int64_t b = std::min<int64_t>(vocab, tiles * s / best * kv::kBlockN);
    begin[s] = static_cast<int32_t>(s == best ? vocab : b);
  }
  return static_cast<int32_t>(best);
}

// The kernels' TMA maps: boxes of {kBlockK, box_outer} over a row-major
// [outer, inner] bf16 matrix.
absl::Status EncodeTiled(PFN_cuTensorMapEncodeTiled_v12000 encode,
                         CUtensorMap* map, const void* base, int64_t inner,
                         int64_t outer, uint32_t box_outer) {
  return EncodeBf16TensorMap(encode, kCudaComponent, map, base, inner, outer,
                             inner, kv::kBlockK, box_outer);
}

// What a combine does about the floors' reruns (CombineParams): mark the
// short rows' blocks, or finish only the marked blocks' rows.
struct RerunMarks {
  int32_t* mark = nullptr;
  uint32_t* top_screen = nullptr;
  const int32_t* only = nullptr;
};

absl::Status EnqueueCombine(const SplitPartials& partials, int32_t num_splits,
                            const LinearLogpBatchView& outputs,
                            int64_t nan_vocab_size, int device,
                            cudaStream_t stream, KernelKind kernel,
                            const RerunMarks& marks = {});

// Rerun marks of a batch of `rows`: one per row block, then their count.
int64_t RerunMarkCount(int64_t rows) {
  return (rows + kv::kBlockM - 1) / kv::kBlockM + 1;
}

// The z a standard normal exceeds with probability `tail` (0 < tail < 0.5),
// by bisection: called once per launch, so plain and exact enough.
double NormalTailQuantile(double tail) {
  double lo = 0.0, hi = 40.0;
  for (int i = 0; i < 64; ++i) {
    const double mid = 0.5 * (lo + hi);
    (0.5 * std::erfc(mid / std::sqrt(2.0)) > tail ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

using SplitKernel = void (*)(const CUtensorMap, const CUtensorMap,
                             const kv::KernelParams);

// The kernel variant for a batch's extras, and its shared memory.
SplitKernel VariantFor(bool entropy, bool top_k) {
  if (top_k) {
    return entropy ? kv::LinearLogpSplitKernel<true, true>
                   : kv::LinearLogpSplitKernel<false, true>;
  }
  return entropy ? kv::LinearLogpSplitKernel<true, false>
                 : kv::LinearLogpSplitKernel<false, false>;
}
int SmemBytesFor(bool top_k) {
  return top_k ? kv::kSmemBytesTopK : kv::kSmemBytes;
}

}  // namespace

struct LinearLogpCuda::Impl {
  CUtensorMap weight_map;  // CUtensorMap is 64-byte aligned by its type
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  int num_sms = 0;
  int cc_major = 0;  // the device's compute capability
  int cc_minor = 0;
  int32_t invariant_splits = 0;
  int32_t invariant_begin[kv::kMaxSplits + 1] = {};
  int64_t shard_begin = 0;
  int smem_optin_bytes = 0;  // shared memory per block (the portable tilings)
  std::string instruction_set;  // for the determinism key
  // The top-k floors' column sample (GatherFloorSample), or null: no floors.
  uint4* floor_sample = nullptr;  // floors::SampleIndex order, then
  float* floor_bias = nullptr;    // [kSampleColumns] or null
};

namespace {

// The launch's row-block group (kernels/item_order.h).
int32_t RowGroup(const LinearLogpCuda::Options& options, bool top_k) {
  if (top_k) {
    return options.top_k_row_group > 0 ? options.top_k_row_group
                                       : kDefaultTopKRowGroup;
  }
  return options.row_group > 0 ? options.row_group : kDefaultRowGroup;
}

}  // namespace

LinearLogpCuda::LinearLogpCuda(const Options& options,
                               std::unique_ptr<Impl> impl)
    : options_(options), impl_(std::move(impl)) {}

LinearLogpCuda::~LinearLogpCuda() {
  if (impl_ != nullptr && impl_->floor_sample != nullptr) {
    DeviceGuard guard;
    if (guard.Enter(options_.device).ok()) cudaFree(impl_->floor_sample);
  }
}

const char* LinearLogpCuda::KernelVersion() { return kv::kVersion; }

const char* LinearLogpCuda::KernelVersion(KernelKind kernel) {
  return kernel == KernelKind::kPortable ? kp::kVersion : kv::kVersion;
}

const char* LinearLogpCuda::kernel_version() const {
  return KernelVersion(options_.kernel);
}

std::string LinearLogpCuda::instruction_set() const {
  return impl_->instruction_set;
}

namespace {

// Loads the portable kernels on the current device (`prop`'s) and names the
// code that runs: the cubin the driver picked, or JIT-compiled PTX and the
// driver that compiled it.
absl::StatusOr<std::string> PreparePortable(const cudaDeviceProp& prop) {
  if (!KernelRunsOn(KernelKind::kPortable, prop.major, prop.minor)) {
    return absl::FailedPreconditionError(
        absl::StrCat("linear_logp_cuda: kernel ", kp::kVersion,
                     " needs compute capability >= 8.0, device has ",
                     prop.major, ".", prop.minor));
  }
  kp::LoadedCode code;
  if (cudaError_t e = kp::PrepareKernels(
          static_cast<int>(prop.sharedMemPerBlockOptin), &code);
      e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "linear_logp_cuda: kernel ", kp::kVersion, " has no code for sm_",
        prop.major, prop.minor, " in this build: ", cudaGetErrorString(e)));
  }
  int driver_version = 0;
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaDriverGetVersion(&driver_version));
  return PortableInstructionSet(prop.major, prop.minor, code.binary_version,
                                code.ptx_version, driver_version,
                                kPortableSassArchs);
}

// The batch-invariant split table of the rows an object holds (a shard's
// boundaries start at 0).
void FillSplitTable(const LinearLogpCuda::Options& options, int32_t all_splits,
                    bool shard, int64_t held_begin, int32_t* splits,
                    int32_t* begin) {
  const int64_t vocab = options.weights.vocab_size;
  const int32_t first = shard ? options.first_split : 0;
  const int32_t end = shard ? options.end_split : all_splits;
  *splits = end - first;
  for (int32_t s = first; s < end; ++s) {
    const VocabRange r = VocabSplitRange(vocab, s);
    begin[s - first] = static_cast<int32_t>(r.begin - held_begin);
    if (s + 1 == end) {
      begin[s + 1 - first] = static_cast<int32_t>(r.end - held_begin);
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<LinearLogpCuda>> LinearLogpCuda::CreatePortable(
    const Options& options, const cudaDeviceProp& prop, int32_t all_splits,
    bool shard, int64_t held_begin) {
  if (prop.major >= 8 &&
      prop.sharedMemPerBlockOptin < static_cast<size_t>(kp::kMinSmemBytes)) {
    return absl::FailedPreconditionError(
        "linear_logp_cuda: not enough shared memory per block");
  }
  auto instruction_set = PreparePortable(prop);
  if (!instruction_set.ok()) return instruction_set.status();
  if (all_splits < 1 || all_splits > kp::kMaxSplits) {
    return absl::InternalError("linear_logp_cuda: split policy out of range");
  }
  auto impl = std::make_unique<Impl>();
  impl->num_sms = prop.multiProcessorCount;
  impl->cc_major = prop.major;
  impl->cc_minor = prop.minor;
  impl->shard_begin = held_begin;
  impl->smem_optin_bytes = static_cast<int>(prop.sharedMemPerBlockOptin);
  impl->instruction_set = *std::move(instruction_set);
  FillSplitTable(options, all_splits, shard, held_begin,
                 &impl->invariant_splits, impl->invariant_begin);
  return std::unique_ptr<LinearLogpCuda>(
      new LinearLogpCuda(options, std::move(impl)));
}

absl::StatusOr<std::string> LinearLogpCuda::InstructionSetOn(KernelKind kernel,
                                                             int device) {
  if (kernel == KernelKind::kHopper) return std::string(kHopperInstructionSet);
  if (kernel != KernelKind::kPortable) {
    return absl::InvalidArgumentError("linear_logp_cuda: bad kernel kind");
  }
  DeviceGuard guard;
  if (absl::Status s = guard.Enter(device); !s.ok()) return s;
  cudaDeviceProp prop;
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  return PreparePortable(prop);
}

namespace {

// Copies the top-k floors' sample columns (vocabulary rows j * (V / n), j <
// n = floors::kSampleColumns), in the order the floor kernel reads them, and
// their bias into one allocation of their own; *sample owns it. Synchronous:
// the launches that read it may run on any stream.
absl::Status GatherFloorSample(const LinearLogpWeightsView& w, uint4** sample,
                               float** bias) {
  constexpr int kColumns = floors::kSampleColumns;
  const size_t sample_bytes = static_cast<size_t>(w.hidden_size) * 2 * kColumns;
  void* buffer = nullptr;
  DETLOGP_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&buffer, sample_bytes + kColumns * sizeof(float)));
  *sample = static_cast<uint4*>(buffer);
  if (w.bias != nullptr) {
    *bias = reinterpret_cast<float*>(static_cast<char*>(buffer) + sample_bytes);
  }
  DETLOGP_CUDA_RETURN_IF_ERROR(floors::EnqueueGatherSample(
      w.weight, w.bias, w.hidden_size, w.vocab_size, *sample, *bias, nullptr));
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LinearLogpCuda>> LinearLogpCuda::Create(
    const Options& options) {
  const LinearLogpWeightsView& w = options.weights;
  if (w.weight == nullptr) {
    return absl::InvalidArgumentError("linear_logp_cuda: weight is null");
  }
  if (!Aligned(w.weight, 16)) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: weight must be 16-byte aligned");
  }
  if (w.bias != nullptr && !Aligned(w.bias, 8)) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: bias must be 8-byte aligned");
  }
  if (w.hidden_size < 64 || w.hidden_size > kMaxHidden ||
      w.hidden_size % 64 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear_logp_cuda: hidden_size must be a multiple of 64 in [64, ",
        kMaxHidden, "], got ", w.hidden_size));
  }
  if (w.vocab_size < 1 || w.vocab_size > kMaxVocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear_logp_cuda: vocab_size out of range: ", w.vocab_size));
  }
  // Bounded so that DecodeItem's group * num_splits stays far from overflow.
  constexpr int32_t kMaxRowGroup = 1 << 16;
  for (const auto& [name, group] :
       {std::pair<const char*, int32_t>{"row_group", options.row_group},
        {"top_k_row_group", options.top_k_row_group}}) {
    if (group < 0 || group > kMaxRowGroup) {
      return absl::InvalidArgumentError(
          absl::StrCat("linear_logp_cuda: ", name, " must be in [0, ",
                       kMaxRowGroup, "] (0: the default), got ", group));
    }
  }
  const bool shard = options.end_split > 0;
  const int32_t all_splits = NumVocabSplits(w.vocab_size);
  int64_t held_begin = 0, held_end = w.vocab_size;  // vocabulary rows used
  if (shard) {
    if (options.first_split < 0 || options.first_split >= options.end_split ||
        options.end_split > all_splits ||
        options.split != SplitMode::kBatchInvariant) {
      return absl::InvalidArgumentError(
          absl::StrCat("linear_logp_cuda: shard splits [", options.first_split,
                       ", ", options.end_split, ") must lie in [0, ",
                       all_splits, ") in batch-invariant mode"));
    }
    held_begin = VocabSplitRange(w.vocab_size, options.first_split).begin;
    held_end = VocabSplitRange(w.vocab_size, options.end_split - 1).end;
  }
  if (w.padded_vocab_size < held_end - held_begin ||
      w.padded_vocab_size > kMaxVocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear_logp_cuda: padded_vocab_size ", w.padded_vocab_size,
        " must be in [", held_end - held_begin, ", ", kMaxVocab,
        "] (the rows this object holds)"));
  }
  if (options.split != SplitMode::kBatchInvariant &&
      options.split != SplitMode::kThroughput) {
    return absl::InvalidArgumentError("linear_logp_cuda: bad split mode");
  }

  DeviceGuard guard;
  if (absl::Status s = guard.Enter(options.device); !s.ok()) return s;
  cudaDeviceProp prop;
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device));
  if (options.kernel == KernelKind::kPortable) {
    return CreatePortable(options, prop, all_splits, shard, held_begin);
  }
  if (options.kernel != KernelKind::kHopper) {
    return absl::InvalidArgumentError("linear_logp_cuda: bad kernel kind");
  }
  if (prop.major != 9 || prop.minor != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("linear_logp_cuda: kernel ", kv::kVersion,
                     " needs compute capability 9.0 (sm_90a), device has ",
                     prop.major, ".", prop.minor));
  }
  if (prop.sharedMemPerBlockOptin < static_cast<size_t>(kv::kSmemBytesTopK)) {
    return absl::FailedPreconditionError(
        "linear_logp_cuda: not enough shared memory per block");
  }
  for (bool entropy : {false, true}) {
    for (bool top_k : {false, true}) {
      SplitKernel kernel = VariantFor(entropy, top_k);
      cudaFuncAttributes attrs;
      DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attrs, kernel));
      DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
          SmemBytesFor(top_k)));
    }
  }

  auto impl = std::make_unique<Impl>();
  impl->num_sms = prop.multiProcessorCount;
  impl->cc_major = prop.major;
  impl->cc_minor = prop.minor;
  impl->instruction_set = kHopperInstructionSet;

  auto encode = TensorMapEncoder(kCudaComponent);
  if (!encode.ok()) return encode.status();
  impl->encode = *encode;
  if (absl::Status s =
          EncodeTiled(impl->encode, &impl->weight_map, w.weight, w.hidden_size,
                      w.padded_vocab_size, kv::kChunkRows);
      !s.ok()) {
    return s;
  }

  if (all_splits < 1 || all_splits > kv::kMaxSplits) {
    return absl::InternalError("linear_logp_cuda: split policy out of range");
  }
  // Split boundaries in the rows this object holds (a shard's start at 0).
  impl->shard_begin = held_begin;
  FillSplitTable(options, all_splits, shard, held_begin,
                 &impl->invariant_splits, impl->invariant_begin);
  auto linear = std::unique_ptr<LinearLogpCuda>(
      new LinearLogpCuda(options, std::move(impl)));
  if (!shard && options.top_k_floors &&
      w.vocab_size >= floors::kSampleColumns) {
    // The object frees the sample, whatever part of it was made.
    if (absl::Status s = GatherFloorSample(w, &linear->impl_->floor_sample,
                                           &linear->impl_->floor_bias);
        !s.ok()) {
      return s;
    }
  }
  return linear;
}

int32_t LinearLogpCuda::SplitTable(int64_t rows, int32_t* begin) const {
  if (options_.split == SplitMode::kBatchInvariant || rows <= 0) {
    std::memcpy(begin, impl_->invariant_begin,
                sizeof(int32_t) * (impl_->invariant_splits + 1));
    return impl_->invariant_splits;
  }
  return ThroughputSplits(rows, options_.weights.vocab_size, impl_->num_sms,
                          begin);
}

int32_t LinearLogpCuda::NumSplits(int64_t rows) const {
  int32_t begin[kv::kMaxSplits + 1];
  return SplitTable(rows, begin);
}

size_t LinearLogpCuda::WorkspaceBytes(int64_t rows, bool entropy,
                                      int32_t top_k) const {
  // Throughput splits never exceed the invariant count, so size for that.
  return PartialsBytes(rows, impl_->invariant_splits, entropy, top_k);
}

size_t LinearLogpCuda::PartialsBytes(int64_t rows, int32_t splits, bool entropy,
                                     int32_t top_k) {
  if (rows <= 0 || splits <= 0) return 0;
  const size_t cells = static_cast<size_t>(rows) * static_cast<size_t>(splits);
  const size_t per_cell = sizeof(float) * (entropy ? 2 : 1) +
                          static_cast<size_t>(std::max(top_k, 0)) *
                              (sizeof(float) + sizeof(int32_t));
  // top_screen: 16-byte aligned rows of kScreenWords keys after the lists,
  // then the rerun marks.
  const size_t screen =
      top_k > 0 ? kScreenAlign + static_cast<size_t>(rows) * kScreenRowBytes +
                      sizeof(int32_t) * RerunMarkCount(rows)
                : 0;
  return cells * per_cell + screen;
}

SplitPartials LinearLogpCuda::PartitionWorkspace(void* workspace, int64_t rows,
                                                 int32_t splits, bool entropy,
                                                 int32_t top_k) {
  const size_t cells = static_cast<size_t>(std::max<int64_t>(rows, 0)) *
                       static_cast<size_t>(std::max(splits, 0));
  float* next = static_cast<float*>(workspace);
  SplitPartials partials;
  partials.lse = next;
  next += cells;
  if (entropy) {
    partials.mean_z = next;
    next += cells;
  }
  if (top_k > 0) {
    partials.top_z = next;
    next += cells * top_k;
    partials.top_ids = reinterpret_cast<int32_t*>(next);
    const uintptr_t end =
        reinterpret_cast<uintptr_t>(partials.top_ids + cells * top_k);
    partials.top_screen = reinterpret_cast<uint32_t*>(
        (end + kScreenAlign - 1) / kScreenAlign * kScreenAlign);
    partials.rerun_blocks = reinterpret_cast<int32_t*>(
        partials.top_screen +
        static_cast<size_t>(rows) * epilogue::kScreenWords);
  }
  return partials;
}

int64_t LinearLogpCuda::ShardBegin() const { return impl_->shard_begin; }

absl::Status LinearLogpCuda::Launch(const LinearLogpBatchView& batch,
                                    void* workspace,
                                    cudaStream_t stream) const {
  if (is_shard()) {
    return absl::FailedPreconditionError(
        "linear_logp_cuda: a shard runs LaunchSplits, then LaunchCombine over "
        "every shard's partials");
  }
  if (batch.rows == 0) return absl::OkStatus();  // a no-op, before checks
  if (workspace == nullptr || !Aligned(workspace, 4) || batch.lse == nullptr ||
      !Aligned(batch.lse, 4)) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: null or misaligned workspace or lse");
  }
  const int32_t splits = NumSplits(batch.rows);
  const SplitPartials partials = PartitionWorkspace(
      workspace, batch.rows, splits, batch.entropy != nullptr, batch.top_k);
  const int64_t vocab = options_.weights.vocab_size;
  const float sigmas = FloorSigmas(batch, partials);
  if (sigmas <= 0.0f) {
    if (absl::Status s = LaunchSplits(batch, partials, stream); !s.ok()) {
      return s;
    }
    return EnqueueCombine(partials, splits, batch, vocab, options_.device,
                          stream, options_.kernel);
  }
  // Floors: the rows a floor left short come out of the first combine
  // marked, and their row blocks run again (both passes are no-ops when
  // none is marked; the host never waits to find out).
  if (absl::Status s = LaunchSplitPass(batch, partials, stream, sigmas,
                                       /*rerun_blocks=*/nullptr);
      !s.ok()) {
    return s;
  }
  RerunMarks mark;
  mark.mark = partials.rerun_blocks;
  mark.top_screen = partials.top_screen;
  if (absl::Status s =
          EnqueueCombine(partials, splits, batch, vocab, options_.device,
                         stream, options_.kernel, mark);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          LaunchSplitPass(batch, partials, stream, 0.0f, partials.rerun_blocks);
      !s.ok()) {
    return s;
  }
  RerunMarks only;
  only.only = partials.rerun_blocks;
  return EnqueueCombine(partials, splits, batch, vocab, options_.device, stream,
                        options_.kernel, only);
}

float LinearLogpCuda::FloorSigmas(const LinearLogpBatchView& batch,
                                  const SplitPartials& partials) const {
  if (options_.kernel != KernelKind::kHopper || is_shard() ||
      impl_->floor_sample == nullptr || batch.top_k <= 0 ||
      batch.rows < options_.top_k_floor_min_rows ||
      partials.top_screen == nullptr || partials.rerun_blocks == nullptr) {
    return 0.0f;
  }
  if (options_.top_k_floor_sigmas > 0.0f) return options_.top_k_floor_sigmas;
  // ~10 k values of the row above the floor if z were normal over the
  // vocabulary, and never fewer than 200: the sample's mean and deviation
  // err by ~6 % and ~4 % of a deviation, so the k-th best lies ~5 of the
  // guess's errors above it at k = 20, V = 151936 (real rows' heavier upper
  // tails put it further). Small vocabularies, where the floor would sit in
  // the bulk, get none.
  constexpr double kMaxTail = 0.05;
  const double above = std::max(200.0, 10.0 * batch.top_k);
  const double tail = above / static_cast<double>(options_.weights.vocab_size);
  if (tail > kMaxTail || options_.weights.vocab_size < floors::kSampleColumns) {
    return 0.0f;
  }
  return static_cast<float>(NormalTailQuantile(tail));
}

namespace {

// The extras' arguments, shared by LaunchSplits and LaunchCombine.
absl::Status ValidateExtras(const LinearLogpBatchView& batch,
                            const SplitPartials& partials, int64_t vocab_size) {
  if (batch.top_k < 0 || batch.top_k > kMaxTopK || batch.top_k > vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear_logp_cuda: top_k must be in [0, min(", kMaxTopK,
                     ", V = ", vocab_size, ")], got ", batch.top_k));
  }
  if (batch.entropy != nullptr && partials.mean_z == nullptr) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: entropy asked for without mean_z partials");
  }
  if (batch.top_k > 0 &&
      (partials.top_z == nullptr || partials.top_ids == nullptr)) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: top_k asked for without top-k partials");
  }
  return absl::OkStatus();
}

// Zeroes the rows' shared top-k screens (no bound yet) before a split pass.
absl::Status ClearTopKScreen(const LinearLogpBatchView& batch,
                             const SplitPartials& partials,
                             cudaStream_t stream) {
  if (batch.top_k <= 0 || partials.top_screen == nullptr) {
    return absl::OkStatus();
  }
  if (!Aligned(partials.top_screen, kScreenAlign)) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: top_screen must be 16-byte aligned");
  }
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      partials.top_screen, 0, kScreenRowBytes * batch.rows, stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status LinearLogpCuda::LaunchSplits(const LinearLogpBatchView& batch,
                                          const SplitPartials& partials,
                                          cudaStream_t stream) const {
  return LaunchSplitPass(batch, partials, stream, 0.0f, nullptr);
}

absl::Status LinearLogpCuda::LaunchSplitPass(
    const LinearLogpBatchView& batch, const SplitPartials& partials,
    cudaStream_t stream, float floor_sigmas,
    const int32_t* rerun_blocks) const {
  float* split_lse = partials.lse;
  const LinearLogpWeightsView& w = options_.weights;
  if (batch.rows < 0 || batch.rows > kMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear_logp_cuda: rows must be in [0, ", kMaxRows,
                     "], got ", batch.rows));
  }
  if (batch.rows == 0) return absl::OkStatus();
  if (batch.hidden == nullptr ||
      (batch.targets == nullptr && batch.targets64 == nullptr) ||
      batch.logprobs == nullptr || split_lse == nullptr) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: null batch pointer or workspace");
  }
  if (!Aligned(batch.hidden, 16)) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: hidden must be 16-byte aligned");
  }
  if (!Aligned(split_lse, 4) || !Aligned(batch.targets, 4) ||
      !Aligned(batch.targets64, 8) || !Aligned(batch.temperatures, 4) ||
      !Aligned(batch.logprobs, 4)) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: misaligned batch pointer or workspace");
  }
  if (batch.temperatures == nullptr &&
      !(std::isfinite(batch.temperature) && batch.temperature > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear_logp_cuda: temperature must be finite and > 0, got ",
        batch.temperature));
  }
  if (absl::Status s = ValidateExtras(batch, partials, w.vocab_size); !s.ok()) {
    return s;
  }

  if (options_.kernel == KernelKind::kPortable) {
    return LaunchPortableSplits(batch, partials, stream);
  }

  DeviceGuard guard;
  if (absl::Status s = guard.Enter(options_.device); !s.ok()) return s;

  CUtensorMap hidden_map;
  // Small batches load only the rows they have (rounded up to 8).
  const int a_box_rows = static_cast<int>(
      std::min<int64_t>(kv::kBlockM, (batch.rows + 7) / 8 * 8));
  if (absl::Status s = EncodeTiled(impl_->encode, &hidden_map, batch.hidden,
                                   w.hidden_size, batch.rows, a_box_rows);
      !s.ok()) {
    return s;
  }

  kv::KernelParams p;
  std::memset(&p, 0, sizeof(p));
  p.bias = w.bias;
  p.targets = batch.targets;
  p.targets64 = batch.targets != nullptr ? nullptr : batch.targets64;
  p.temperatures = batch.temperatures;
  p.temperature = batch.temperature;
  p.logprobs = batch.logprobs;
  p.split_lse = split_lse;
  // Entropy partials whenever there is room for them (a shard's caller
  // wants them without an entropy output of its own).
  const bool entropy = partials.mean_z != nullptr;
  const bool top_k = batch.top_k > 0;
  p.split_mean_z = entropy ? partials.mean_z : nullptr;
  p.split_top_z = top_k ? partials.top_z : nullptr;
  p.split_top_id = top_k ? partials.top_ids : nullptr;
  p.top_screen = top_k ? partials.top_screen : nullptr;
  p.top_k = batch.top_k;
  p.id_offset = static_cast<int32_t>(impl_->shard_begin);
  p.rows = static_cast<int32_t>(batch.rows);
  p.k_blocks = static_cast<int32_t>(w.hidden_size / kv::kBlockK);
  p.num_splits = SplitTable(batch.rows, p.split_begin);
  p.num_row_blocks =
      static_cast<int32_t>((batch.rows + kv::kBlockM - 1) / kv::kBlockM);
  p.num_items = p.num_row_blocks * p.num_splits;
  p.row_group = RowGroup(options_, top_k);
  p.a_box_rows = a_box_rows;
  p.rerun_blocks = top_k ? rerun_blocks : nullptr;
  const int grid = std::min(impl_->num_sms, p.num_items);

  (void)cudaGetLastError();  // clear a stale, non-sticky error of this thread
  if (rerun_blocks != nullptr) {
    // The screens as the first pass and the combine left them.
  } else if (floor_sigmas > 0.0f) {
    floors::FloorParams f;
    f.hidden = batch.hidden;
    f.sample = impl_->floor_sample;
    f.sample_bias = impl_->floor_bias;
    f.temperatures = batch.temperatures;
    f.temperature = batch.temperature;
    f.hidden_size = w.hidden_size;
    f.rows = p.rows;
    f.k_splits = floors::FloorKSplits(batch.rows, impl_->num_sms);
    f.sigmas = floor_sigmas;
    f.top_screen = partials.top_screen;
    f.rerun_blocks = partials.rerun_blocks;
    f.row_blocks = p.num_row_blocks;
    f.block_rows = kv::kBlockM;
    DETLOGP_CUDA_RETURN_IF_ERROR(floors::EnqueueFloorKernel(f, stream));
  } else if (absl::Status s = ClearTopKScreen(batch, partials, stream);
             !s.ok()) {
    return s;
  }
  VariantFor(entropy,
             top_k)<<<grid, kv::kThreads, SmemBytesFor(top_k), stream>>>(
      hidden_map, impl_->weight_map, p);
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LinearLogpCuda::LaunchPortableSplits(
    const LinearLogpBatchView& batch, const SplitPartials& partials,
    cudaStream_t stream) const {
  const LinearLogpWeightsView& w = options_.weights;
  DeviceGuard guard;
  if (absl::Status s = guard.Enter(options_.device); !s.ok()) return s;

  kp::KernelParams p;
  std::memset(&p, 0, sizeof(p));
  p.hidden = batch.hidden;
  p.weight = w.weight;
  p.bias = w.bias;
  p.targets = batch.targets;
  p.targets64 = batch.targets != nullptr ? nullptr : batch.targets64;
  p.temperatures = batch.temperatures;
  p.temperature = batch.temperature;
  p.logprobs = batch.logprobs;
  p.split_lse = partials.lse;
  // Entropy partials whenever there is room for them, as for v3.
  p.split_mean_z = partials.mean_z;
  p.split_top_z = batch.top_k > 0 ? partials.top_z : nullptr;
  p.split_top_id = batch.top_k > 0 ? partials.top_ids : nullptr;
  p.top_screen = batch.top_k > 0 ? partials.top_screen : nullptr;
  p.top_k = batch.top_k;
  p.id_offset = static_cast<int32_t>(impl_->shard_begin);
  p.hidden_size = w.hidden_size;
  p.padded_vocab = w.padded_vocab_size;
  p.rows = static_cast<int32_t>(batch.rows);
  p.k_blocks = static_cast<int32_t>(w.hidden_size / kp::kBlockK);
  p.num_splits = SplitTable(batch.rows, p.split_begin);
  p.row_group = RowGroup(options_, batch.top_k > 0);

  (void)cudaGetLastError();  // clear a stale, non-sticky error of this thread
  if (absl::Status s = ClearTopKScreen(batch, partials, stream); !s.ok()) {
    return s;
  }
  DETLOGP_CUDA_RETURN_IF_ERROR(
      kp::EnqueueSplitKernel(p, impl_->smem_optin_bytes, stream));
  return absl::OkStatus();
}

namespace {

// LaunchCombine's body. nan_vocab_size > 0: rows whose target (from
// outputs.targets or outputs.targets64) lies outside [0, nan_vocab_size) get
// a NaN logprob (Launch: the whole vocabulary); 0: targets are not read.
absl::Status EnqueueCombine(const SplitPartials& partials, int32_t num_splits,
                            const LinearLogpBatchView& outputs,
                            int64_t nan_vocab_size, int device,
                            cudaStream_t stream, KernelKind kernel,
                            const RerunMarks& marks) {
  const int64_t rows = outputs.rows;
  if (rows <= 0) return absl::OkStatus();
  if (partials.lse == nullptr || outputs.logprobs == nullptr ||
      outputs.lse == nullptr || num_splits < 1 || rows > kMaxRows) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: bad combine arguments");
  }
  if (absl::Status s = ValidateExtras(outputs, partials, kMaxTopK); !s.ok()) {
    return s;
  }
  if (outputs.top_k > 0 &&
      (outputs.top_ids == nullptr || outputs.top_logprobs == nullptr)) {
    return absl::InvalidArgumentError(
        "linear_logp_cuda: top_k asked for without top_ids/top_logprobs");
  }
  DeviceGuard guard;
  if (absl::Status s = guard.Enter(device); !s.ok()) return s;
  combine::CombineParams p = {};
  p.split_lse = partials.lse;
  p.split_mean_z = outputs.entropy != nullptr ? partials.mean_z : nullptr;
  p.split_top_z = outputs.top_k > 0 ? partials.top_z : nullptr;
  p.split_top_id = outputs.top_k > 0 ? partials.top_ids : nullptr;
  p.num_splits = num_splits;
  p.rows = static_cast<int32_t>(rows);
  p.top_k = outputs.top_k;
  p.logprobs = outputs.logprobs;
  p.lse = outputs.lse;
  p.entropy = outputs.entropy;
  p.top_ids = outputs.top_k > 0 ? outputs.top_ids : nullptr;
  p.top_logprobs = outputs.top_logprobs;
  p.targets = nan_vocab_size > 0 ? outputs.targets : nullptr;
  p.targets64 = nan_vocab_size > 0 && outputs.targets == nullptr
                    ? outputs.targets64
                    : nullptr;
  p.vocab_size = static_cast<int32_t>(nan_vocab_size);
  p.mark_blocks = outputs.top_k > 0 ? marks.mark : nullptr;
  p.top_screen = marks.top_screen;
  p.only_blocks = marks.only;
  p.block_rows = kv::kBlockM;
  p.row_blocks = static_cast<int32_t>(RerunMarkCount(rows) - 1);
  if (kernel == KernelKind::kPortable) {
    DETLOGP_CUDA_RETURN_IF_ERROR(kp::EnqueueCombineKernel(p, stream));
  } else {
    DETLOGP_CUDA_RETURN_IF_ERROR(
        combine::EnqueueCombineKernels(p, stream, /*dependent_launch=*/true));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LinearLogpCuda::LaunchCombine(const SplitPartials& partials,
                                           int32_t num_splits,
                                           const LinearLogpBatchView& outputs,
                                           int device, cudaStream_t stream,
                                           KernelKind kernel) {
  return EnqueueCombine(partials, num_splits, outputs, /*nan_vocab_size=*/0,
                        device, stream, kernel);
}

}  // namespace detlogp::kernels::cuda
