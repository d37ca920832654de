// Launcher for the linear-logp backward (linear_logp_backward_kernel.cuh).
#include "kernels/cuda/linear_logp_backward_cuda.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_host.h"
#include "kernels/cuda/linear_logp_backward_kernel.cuh"

namespace detlogp::kernels::cuda {
namespace {

namespace kb = ::detlogp::kernels::cuda::backward_v1;

constexpr char kCudaComponent[] = "linear_logp_backward_cuda";

absl::Status Invalid(const char* field, const char* why) {
  return absl::InvalidArgumentError(
      absl::StrCat("linear_logp_backward_cuda: ", field, " ", why));
}

constexpr int64_t kMaxRows = int64_t{1} << 24;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t RoundUp256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// A K-major operand map (boxes of {kBlockK, rows}) and an MN-major one
// (boxes of {kMnBlock, kBlockK}) over the same matrix.
struct OperandMaps {
  CUtensorMap k_major;
  CUtensorMap mn_major;
};

absl::Status EncodeOperand(PFN_cuTensorMapEncodeTiled_v12000 encode,
                           OperandMaps* maps, const void* base, int64_t inner,
                           int64_t outer, int64_t row_stride,
                           uint32_t k_major_box_rows) {
  if (absl::Status s = EncodeBf16TensorMap(
          encode, kCudaComponent, &maps->k_major, base, inner, outer,
          row_stride, kb::kBlockK, k_major_box_rows);
      !s.ok()) {
    return s;
  }
  return EncodeBf16TensorMap(encode, kCudaComponent, &maps->mn_major, base,
                             inner, outer, row_stride, kb::kMnBlock,
                             kb::kBlockK);
}

// A map for TMA stores of the epilogues: boxes of {128 bytes of columns,
// kStageRows rows} under the 128-byte swizzle, over a row-major
// [outer][inner] matrix of `row_stride` elements a row.
absl::Status EncodeStoreMap(PFN_cuTensorMapEncodeTiled_v12000 encode,
                            CUtensorMap* map, const void* base, bool fp32,
                            int64_t inner, int64_t outer, int64_t row_stride) {
  const cuuint64_t element = fp32 ? 4 : 2;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner),
                              static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * element};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element),
                             kb::kStageRows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(
      map,
      fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      2, const_cast<void*>(base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        kCudaComponent,
        ": cuTensorMapEncodeTiled (store) failed: ", static_cast<int>(r)));
  }
  return absl::OkStatus();
}

// K1: A = hidden (K-major), B = W (K-major). K2: A = G (K-major), B = W
// (MN-major). K3: A = G (MN-major), B = hidden (MN-major).
const auto kGradLogitsGemm = kb::Gemm<false, false, kb::GradLogitsEpilogue>;
const auto kHiddenGradGemm = kb::Gemm<false, true, kb::RowsOutEpilogue>;
const auto kWeightGradGemm = kb::Gemm<true, true, kb::RowsOutEpilogue>;

template <class Epilogue>
absl::Status EnqueueGemm(void (*kernel)(const CUtensorMap, const CUtensorMap,
                                        const kb::GemmShape, const Epilogue),
                         const CUtensorMap& a, const CUtensorMap& b,
                         const kb::GemmShape& shape, const Epilogue& epilogue,
                         int sm_count, cudaStream_t stream) {
  // Persistent: at most one block per SM, each looping over tiles.
  const int64_t tiles = CeilDiv(shape.m, kb::kBlockM) * shape.tiles_n;
  const int64_t blocks = std::min<int64_t>(tiles, sm_count);
  kernel<<<static_cast<unsigned>(blocks), kb::kThreads, kb::kSmemBytes,
           stream>>>(a, b, shape, epilogue);
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Byte offsets of the workspace's parts for passes of `pass_rows` rows.
struct WorkspaceLayout {
  size_t grad = 0;          // G: [pass_rows][kChunkCols] bf16
  size_t hidden_acc = 0;    // fp32 dhidden when grad_hidden is bf16
  size_t bias_partial = 0;  // [slices][kChunkCols] fp32
  size_t total = 0;
};

WorkspaceLayout LayoutFor(int64_t rows, int64_t hidden_size,
                          bool bf16_grad_hidden, bool grad_bias) {
  const int64_t pass_rows =
      std::min(rows, LinearLogpBackwardCuda::kMaxRowsPerPass);
  WorkspaceLayout l;
  size_t at = 0;
  l.grad = at;
  at += RoundUp256(static_cast<size_t>(pass_rows) * kb::kChunkCols * 2);
  l.hidden_acc = at;
  if (bf16_grad_hidden) {
    at += RoundUp256(static_cast<size_t>(pass_rows) * hidden_size * 4);
  }
  l.bias_partial = at;
  if (grad_bias) {
    at +=
        RoundUp256(static_cast<size_t>(CeilDiv(pass_rows, kb::kBiasSliceRows)) *
                   kb::kChunkCols * 4);
  }
  l.total = at;
  return l;
}

WorkspaceLayout LayoutFor(const LinearLogpGradView& g, int64_t hidden_size) {
  return LayoutFor(
      g.rows, hidden_size,
      g.grad_hidden != nullptr && g.grad_hidden_dtype == GradDtype::kBfloat16,
      g.grad_bias != nullptr);
}

template <class T>
const T* Offset(const T* p, int64_t n) {
  return p == nullptr ? nullptr : p + n;
}

}  // namespace

struct LinearLogpBackwardCuda::Impl {
  OperandMaps weight;  // CUtensorMap is 64-byte aligned by its type
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  int sm_count = 0;  // the persistent GEMMs' grid
};

LinearLogpBackwardCuda::LinearLogpBackwardCuda(const Options& options,
                                               std::unique_ptr<Impl> impl)
    : options_(options), impl_(std::move(impl)) {}

LinearLogpBackwardCuda::~LinearLogpBackwardCuda() = default;

const char* LinearLogpBackwardCuda::KernelVersion() { return kb::kVersion; }

absl::StatusOr<std::unique_ptr<LinearLogpBackwardCuda>>
LinearLogpBackwardCuda::Create(const Options& options) {
  const LinearLogpWeightsView& w = options.weights;
  if (w.weight == nullptr || !Aligned(w.weight, 16)) {
    return Invalid("weights.weight", "must be a 16-byte aligned pointer");
  }
  if (w.bias != nullptr && !Aligned(w.bias, 8)) {
    return Invalid("weights.bias", "must be 8-byte aligned");
  }
  if (w.hidden_size < 64 || w.hidden_size > 65536 || w.hidden_size % 64 != 0) {
    return Invalid("weights.hidden_size",
                   "must be a multiple of 64 in [64, 65536]");
  }
  if (w.vocab_size < 1 || w.padded_vocab_size < w.vocab_size ||
      w.padded_vocab_size > (int64_t{1} << 31) - kb::kChunkCols) {
    return Invalid("weights.vocab_size",
                   "must be >= 1 and <= padded_vocab_size < 2^31 - 4096");
  }
  DeviceGuard guard;
  if (absl::Status s = guard.Enter(options.device); !s.ok()) return s;
  cudaDeviceProp prop;
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device));
  if (prop.major != 9 || prop.minor != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("linear_logp_backward_cuda: kernel ", kb::kVersion,
                     " needs compute capability 9.0 (sm_90a), device has ",
                     prop.major, ".", prop.minor));
  }
  if (prop.sharedMemPerBlockOptin < static_cast<size_t>(kb::kSmemBytes)) {
    return absl::FailedPreconditionError(
        "linear_logp_backward_cuda: not enough shared memory per block");
  }
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kGradLogitsGemm, cudaFuncAttributeMaxDynamicSharedMemorySize,
      kb::kSmemBytes));
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kHiddenGradGemm, cudaFuncAttributeMaxDynamicSharedMemorySize,
      kb::kSmemBytes));
  DETLOGP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kWeightGradGemm, cudaFuncAttributeMaxDynamicSharedMemorySize,
      kb::kSmemBytes));

  auto impl = std::make_unique<Impl>();
  auto encode = TensorMapEncoder(kCudaComponent);
  if (!encode.ok()) return encode.status();
  impl->encode = *encode;
  impl->sm_count = prop.multiProcessorCount;
  if (absl::Status s =
          EncodeOperand(impl->encode, &impl->weight, w.weight, w.hidden_size,
                        w.padded_vocab_size, w.hidden_size, kb::kBlockN);
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<LinearLogpBackwardCuda>(
      new LinearLogpBackwardCuda(options, std::move(impl)));
}

size_t LinearLogpBackwardCuda::WorkspaceBytes(
    const LinearLogpGradView& grads) const {
  return LayoutFor(grads, options_.weights.hidden_size).total;
}

size_t LinearLogpBackwardCuda::WorkspaceBytes(int64_t rows,
                                              bool bf16_grad_hidden,
                                              bool grad_bias) const {
  return LayoutFor(rows, options_.weights.hidden_size, bf16_grad_hidden,
                   grad_bias)
      .total;
}

absl::Status LinearLogpBackwardCuda::Validate(const LinearLogpGradView& g,
                                              const void* workspace,
                                              size_t workspace_bytes) const {
  if (g.rows < 1 || g.rows > kMaxRows) {
    return Invalid("rows", "must be in [1, 2^24]");
  }
  if (g.hidden == nullptr || !Aligned(g.hidden, 16)) {
    return Invalid("hidden", "must be a 16-byte aligned pointer");
  }
  if (g.lse == nullptr) return Invalid("lse", "is required (the forward's)");
  if (g.grad_logprobs != nullptr && g.targets == nullptr &&
      g.targets64 == nullptr) {
    return Invalid("targets", "are required with grad_logprobs");
  }
  if (g.grad_entropy != nullptr && g.entropy == nullptr) {
    return Invalid("entropy", "is required with grad_entropy (the forward's)");
  }
  if (g.temperatures == nullptr &&
      !(g.temperature > 0.0f && g.temperature < INFINITY)) {
    return Invalid("temperature", "must be finite and > 0");
  }
  if (g.grad_hidden == nullptr && g.grad_weight == nullptr &&
      g.grad_bias == nullptr) {
    return Invalid("grad_hidden/grad_weight/grad_bias", "are all null");
  }
  const void* outputs[] = {g.grad_hidden, g.grad_weight, g.grad_bias};
  for (const void* out : outputs) {
    if (!Aligned(out, 16)) {
      return Invalid("grad_hidden/grad_weight/grad_bias",
                     "must be 16-byte aligned");
    }
  }
  if (g.grad_weight != nullptr && g.grad_weight_dtype == GradDtype::kBfloat16 &&
      g.rows > kMaxRowsPerPass) {
    return Invalid("grad_weight_dtype",
                   "bf16 needs rows <= 16384 (larger batches accumulate "
                   "dweight across passes in fp32)");
  }
  if (workspace_bytes < WorkspaceBytes(g) || !Aligned(workspace, 256)) {
    return Invalid("workspace",
                   "is smaller than WorkspaceBytes() or not "
                   "256-byte aligned");
  }
  return absl::OkStatus();
}

absl::Status LinearLogpBackwardCuda::Launch(const LinearLogpGradView& g,
                                            void* workspace,
                                            size_t workspace_bytes,
                                            cudaStream_t stream) const {
  if (absl::Status s = Validate(g, workspace, workspace_bytes); !s.ok()) {
    return s;
  }
  const LinearLogpWeightsView& w = options_.weights;
  const int64_t hidden = w.hidden_size;
  const WorkspaceLayout layout = LayoutFor(g, hidden);
  auto* ws = static_cast<uint8_t*>(workspace);
  auto* grad = reinterpret_cast<__nv_bfloat16*>(ws + layout.grad);
  auto* hidden_acc = reinterpret_cast<float*>(ws + layout.hidden_acc);
  auto* bias_partial = reinterpret_cast<float*>(ws + layout.bias_partial);
  const bool hidden_bf16 = g.grad_hidden_dtype == GradDtype::kBfloat16;
  const bool weight_bf16 = g.grad_weight_dtype == GradDtype::kBfloat16;
  const int64_t chunks = CeilDiv(w.padded_vocab_size, kb::kChunkCols);
  const int32_t hidden_tiles =
      static_cast<int32_t>(CeilDiv(hidden, kb::kBlockN));

  // Every tensor map is built before the first launch, so that an error
  // leaves the outputs untouched: the hidden rows of each pass, and G's for
  // each (pass rows, chunk width) pair that occurs.
  const int64_t passes = CeilDiv(g.rows, kMaxRowsPerPass);
  std::vector<OperandMaps> hidden_maps(passes);
  std::vector<OperandMaps> grad_maps(4);  // [last pass?][last chunk?]
  std::vector<CUtensorMap> hidden_out_maps(passes);
  std::vector<CUtensorMap> hidden_bf16_maps(passes);
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t r0 = pass * kMaxRowsPerPass;
    const int64_t rows = std::min(kMaxRowsPerPass, g.rows - r0);
    if (absl::Status s = EncodeOperand(impl_->encode, &hidden_maps[pass],
                                       g.hidden + r0 * hidden, hidden, rows,
                                       hidden, kb::kBlockM);
        !s.ok()) {
      return s;
    }
    for (int64_t c : {int64_t{0}, chunks - 1}) {
      const int64_t width = std::min<int64_t>(
          kb::kChunkCols, w.padded_vocab_size - c * kb::kChunkCols);
      OperandMaps& maps =
          grad_maps[2 * (pass + 1 == passes) + (c + 1 == chunks)];
      if (absl::Status s = EncodeOperand(impl_->encode, &maps, grad, width,
                                         rows, kb::kChunkCols, kb::kBlockM);
          !s.ok()) {
        return s;
      }
    }
    // K2's fp32 dhidden of the pass: the accumulator or the output.
    if (g.grad_hidden != nullptr) {
      float* f32 = hidden_bf16
                       ? hidden_acc
                       : static_cast<float*>(g.grad_hidden) + r0 * hidden;
      if (absl::Status s =
              EncodeStoreMap(impl_->encode, &hidden_out_maps[pass], f32,
                             /*fp32=*/true, hidden, rows, hidden);
          !s.ok()) {
        return s;
      }
      // (A single chunk stores the bf16 dhidden straight away.)
      if (hidden_bf16) {
        if (absl::Status s = EncodeStoreMap(
                impl_->encode, &hidden_bf16_maps[pass],
                static_cast<const __nv_bfloat16*>(g.grad_hidden) + r0 * hidden,
                /*fp32=*/false, hidden, rows, hidden);
            !s.ok()) {
          return s;
        }
      }
    }
  }
  // K3's dweight, all of it (row coordinates start at the chunk's).
  CUtensorMap weight_out_map{};
  if (g.grad_weight != nullptr) {
    if (absl::Status s =
            EncodeStoreMap(impl_->encode, &weight_out_map, g.grad_weight,
                           !weight_bf16, hidden, w.padded_vocab_size, hidden);
        !s.ok()) {
      return s;
    }
  }

  DeviceGuard guard;
  if (absl::Status s = guard.Enter(options_.device); !s.ok()) return s;

  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t r0 = pass * kMaxRowsPerPass;
    const int32_t rows =
        static_cast<int32_t>(std::min(kMaxRowsPerPass, g.rows - r0));
    const OperandMaps& hidden_pass = hidden_maps[pass];
    kb::GradLogitsParams logits{};
    logits.bias = w.bias;
    logits.targets = Offset(g.targets, r0);
    logits.targets64 = Offset(g.targets64, r0);
    logits.temperatures = Offset(g.temperatures, r0);
    logits.temperature = g.temperature;
    logits.lse = g.lse + r0;
    logits.entropy = Offset(g.entropy, r0);
    logits.grad_logprobs = Offset(g.grad_logprobs, r0);
    logits.grad_lse = Offset(g.grad_lse, r0);
    logits.grad_entropy = Offset(g.grad_entropy, r0);
    logits.vocab_size = static_cast<int32_t>(w.vocab_size);
    logits.grad = grad;

    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t begin = static_cast<int32_t>(c * kb::kChunkCols);
      const int32_t width = static_cast<int32_t>(
          std::min<int64_t>(kb::kChunkCols, w.padded_vocab_size - begin));
      const OperandMaps& grad_chunk =
          grad_maps[2 * (pass + 1 == passes) + (c + 1 == chunks)];
      // K1: G for the chunk.
      logits.chunk_begin = begin;
      const kb::GemmShape logits_shape{
          rows, width, static_cast<int32_t>(hidden / kb::kBlockK),
          static_cast<int32_t>(CeilDiv(width, kb::kBlockN)), begin};
      if (absl::Status s = EnqueueGemm(kGradLogitsGemm, hidden_pass.k_major,
                                       impl_->weight.k_major, logits_shape,
                                       kb::GradLogitsEpilogue{logits},
                                       impl_->sm_count, stream);
          !s.ok()) {
        return s;
      }
      // K2: dhidden (+)= G · W_c, in fp32 (bf16 written by the last chunk).
      if (g.grad_hidden != nullptr) {
        const int64_t at = r0 * hidden;
        kb::RowsOutParams out{};
        out.f32_map = hidden_out_maps[pass];
        out.bf16_map = hidden_bf16_maps[pass];
        out.f32 =
            hidden_bf16 ? hidden_acc : static_cast<float*>(g.grad_hidden) + at;
        out.bf16 = hidden_bf16 && c + 1 == chunks
                       ? static_cast<__nv_bfloat16*>(g.grad_hidden) + at
                       : nullptr;
        out.ld = hidden;
        out.accumulate = c > 0;
        const kb::GemmShape shape{
            rows, static_cast<int32_t>(hidden),
            static_cast<int32_t>(CeilDiv(width, kb::kBlockK)), hidden_tiles,
            begin};
        if (absl::Status s = EnqueueGemm(
                kHiddenGradGemm, grad_chunk.k_major, impl_->weight.mn_major,
                shape, kb::RowsOutEpilogue{out}, impl_->sm_count, stream);
            !s.ok()) {
          return s;
        }
      }
      // K3: dweight rows of the chunk = Gᵀ · hidden (accumulated across
      // passes in fp32).
      if (g.grad_weight != nullptr) {
        const int64_t at = static_cast<int64_t>(begin) * hidden;
        kb::RowsOutParams out{};
        (weight_bf16 ? out.bf16_map : out.f32_map) = weight_out_map;
        out.f32 =
            weight_bf16 ? nullptr : static_cast<float*>(g.grad_weight) + at;
        out.bf16 = weight_bf16 ? static_cast<__nv_bfloat16*>(g.grad_weight) + at
                               : nullptr;
        out.ld = hidden;
        out.row0 = begin;
        out.accumulate = pass > 0;
        const kb::GemmShape shape{
            width, static_cast<int32_t>(hidden),
            static_cast<int32_t>(CeilDiv(rows, kb::kBlockK)), hidden_tiles, 0};
        if (absl::Status s = EnqueueGemm(
                kWeightGradGemm, grad_chunk.mn_major, hidden_pass.mn_major,
                shape, kb::RowsOutEpilogue{out}, impl_->sm_count, stream);
            !s.ok()) {
          return s;
        }
      }
      if (g.grad_bias != nullptr) {
        const int32_t slices =
            static_cast<int32_t>(CeilDiv(rows, kb::kBiasSliceRows));
        const unsigned col_blocks = static_cast<unsigned>(CeilDiv(width, 256));
        kb::BiasPartialKernel<<<dim3(col_blocks, slices), 256, 0, stream>>>(
            grad, rows, width, bias_partial);
        kb::BiasFoldKernel<<<col_blocks, 256, 0, stream>>>(
            bias_partial, slices, width, pass > 0 ? 1 : 0, g.grad_bias + begin);
        DETLOGP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace detlogp::kernels::cuda
