// The C ABI over the CPU kernels (detlogp_ops.h). Every entry point validates
// its arguments before computing, then calls the same kernel functions the CPU
// server's backends call, so the bits are the served bits.
#include "kernels/capi/detlogp_ops.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/capi/capi_util.h"
#include "kernels/linear_logp_cpu.h"
#include "kernels/lm_head.h"
#include "kernels/projection.h"
#include "kernels/projection_grad.h"
#include "kernels/split_policy.h"
#include "kernels/thread_pool.h"

namespace {

using detlogp::capi::CheckHead;
using detlogp::capi::ClearError;
using detlogp::capi::Fail;

}  // namespace

extern "C" {

int detlogp_ops_abi_version(void) { return DETLOGP_OPS_ABI_VERSION; }

int detlogp_cpu_linear_logp(const uint16_t* weight, int64_t padded_vocab_size,
                            int64_t hidden_size, const float* bias,
                            int64_t vocab_size, const uint16_t* hidden,
                            int64_t rows, const int32_t* targets,
                            const float* temperatures, int num_threads,
                            float* logprobs, float* lse, float* entropy,
                            char* error, size_t error_len) {
  try {
    ClearError(error, error_len);
    std::string bad =
        CheckHead(weight, padded_vocab_size, hidden_size, vocab_size);
    if (!bad.empty()) return Fail(bad, error, error_len);
    if (rows < 0) {
      return Fail(absl::StrCat("rows: must be >= 0, got ", rows), error,
                  error_len);
    }
    if (rows == 0) return 0;
    if (hidden == nullptr)
      return Fail("hidden: null pointer", error, error_len);
    if (targets == nullptr) {
      return Fail("targets: null pointer", error, error_len);
    }
    if (temperatures == nullptr) {
      return Fail("temperatures: null pointer", error, error_len);
    }
    if (logprobs == nullptr) {
      return Fail("logprobs: null pointer", error, error_len);
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (targets[r] < 0 || targets[r] >= vocab_size) {
        return Fail(absl::StrCat("targets[", r, "] = ", targets[r],
                                 " is outside [0, ", vocab_size, ")"),
                    error, error_len);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (!std::isfinite(temperatures[r]) || !(temperatures[r] > 0.0f)) {
        return Fail(absl::StrCat("temperatures[", r, "] = ", temperatures[r],
                                 " is not finite and positive"),
                    error, error_len);
      }
    }
    std::vector<float> lse_scratch;
    if (lse == nullptr) {
      lse_scratch.resize(rows);
      lse = lse_scratch.data();
    }
    detlogp::kernels::LmHeadView head;
    head.hidden_size = hidden_size;
    head.vocab_size = vocab_size;
    head.padded_vocab_size = padded_vocab_size;
    head.weight = weight;
    head.bias = bias;
    detlogp::kernels::LogpRowsView view;
    view.rows = rows;
    view.hidden = hidden;
    view.targets = targets;
    view.temperatures = temperatures;
    view.logprobs = logprobs;
    view.lse = lse;
    view.entropy = entropy;
    absl::Status status;
    if (num_threads == 1) {
      status = detlogp::kernels::ComputeLinearLogpCpu(head, view, nullptr);
    } else {
      detlogp::kernels::ThreadPool pool(num_threads);
      status = detlogp::kernels::ComputeLinearLogpCpu(head, view, &pool);
    }
    if (!status.ok()) return Fail(status.ToString(), error, error_len);
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int64_t detlogp_h3_projection_in_dim(void) {
  return detlogp::kernels::kProjectionInDim;
}
int64_t detlogp_h3_projection_out_dim(void) {
  return detlogp::kernels::kProjectionOutDim;
}

int detlogp_cpu_h3_projection(const float* x, int64_t rows, const float* weight,
                              const float* bias, int num_threads, float* y,
                              char* error, size_t error_len) {
  using detlogp::kernels::kProjectionInDim;
  using detlogp::kernels::kProjectionMaxRows;
  using detlogp::kernels::kProjectionOutDim;
  try {
    ClearError(error, error_len);
    if (weight == nullptr)
      return Fail("weight: null pointer", error, error_len);
    if (rows < 0 || rows > kProjectionMaxRows) {
      return Fail(absl::StrCat("rows: must be in [0, ", kProjectionMaxRows,
                               "], got ", rows),
                  error, error_len);
    }
    if (rows > 0 && x == nullptr)
      return Fail("x: null pointer", error, error_len);
    if (rows > 0 && y == nullptr)
      return Fail("y: null pointer", error, error_len);
    detlogp::kernels::ProjectionCpu::Options options;
    options.weight =
        absl::MakeConstSpan(weight, kProjectionOutDim * kProjectionInDim);
    if (bias != nullptr)
      options.bias = absl::MakeConstSpan(bias, kProjectionOutDim);
    options.num_threads = num_threads;
    auto kernel = detlogp::kernels::ProjectionCpu::Create(options);
    if (!kernel.ok()) return Fail(kernel.status().ToString(), error, error_len);
    absl::Status status =
        (*kernel)->Forward(absl::MakeConstSpan(x, rows * kProjectionInDim),
                           rows, absl::MakeSpan(y, rows * kProjectionOutDim));
    if (!status.ok()) return Fail(status.ToString(), error, error_len);
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int detlogp_cpu_h3_projection_input_grad(const float* weight, const float* dy,
                                         int64_t rows, int num_threads,
                                         float* dx, char* error,
                                         size_t error_len) {
  using detlogp::kernels::kProjectionInDim;
  using detlogp::kernels::kProjectionMaxRows;
  using detlogp::kernels::kProjectionOutDim;
  try {
    ClearError(error, error_len);
    if (weight == nullptr)
      return Fail("weight: null pointer", error, error_len);
    if (rows < 0 || rows > kProjectionMaxRows) {
      return Fail(absl::StrCat("rows: must be in [0, ", kProjectionMaxRows,
                               "], got ", rows),
                  error, error_len);
    }
    if (rows == 0) return 0;
    if (dy == nullptr) return Fail("dy: null pointer", error, error_len);
    if (dx == nullptr) return Fail("dx: null pointer", error, error_len);
    absl::Status status = detlogp::kernels::ProjectionInputGrad(
        absl::MakeConstSpan(weight, kProjectionOutDim * kProjectionInDim),
        absl::MakeConstSpan(dy, rows * kProjectionOutDim), rows,
        absl::MakeSpan(dx, rows * kProjectionInDim), num_threads);
    if (!status.ok()) return Fail(status.ToString(), error, error_len);
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int detlogp_cpu_h3_projection_weight_grad(const float* dy, const float* x,
                                          int64_t rows, int64_t first_key,
                                          int num_threads, float* dweight,
                                          float* dbias, char* error,
                                          size_t error_len) {
  using detlogp::kernels::kProjectionInDim;
  using detlogp::kernels::kProjectionMaxRows;
  using detlogp::kernels::kProjectionOutDim;
  try {
    ClearError(error, error_len);
    if (rows < 0 || rows > kProjectionMaxRows) {
      return Fail(absl::StrCat("rows: must be in [0, ", kProjectionMaxRows,
                               "], got ", rows),
                  error, error_len);
    }
    if (first_key < 0 || first_key > INT64_MAX - rows) {
      return Fail(absl::StrCat("first_key: must be >= 0 with first_key + rows "
                               "in int64, got ",
                               first_key),
                  error, error_len);
    }
    if (dweight == nullptr) {
      return Fail("dweight: null pointer", error, error_len);
    }
    if (rows > 0 && dy == nullptr)
      return Fail("dy: null pointer", error, error_len);
    if (rows > 0 && x == nullptr)
      return Fail("x: null pointer", error, error_len);
    std::vector<int64_t> keys(rows);
    for (int64_t i = 0; i < rows; ++i) keys[i] = first_key + i;
    auto grads = detlogp::kernels::ComputeProjectionWeightGrads(
        absl::MakeConstSpan(dy, rows * kProjectionOutDim),
        absl::MakeConstSpan(x, rows * kProjectionInDim), keys, num_threads);
    if (!grads.ok()) return Fail(grads.status().ToString(), error, error_len);
    std::memcpy(dweight, grads->dweight.data(),
                sizeof(float) * kProjectionOutDim * kProjectionInDim);
    if (dbias != nullptr) {
      std::memcpy(dbias, grads->dbias.data(),
                  sizeof(float) * kProjectionOutDim);
    }
    return 0;
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

int detlogp_cpu_determinism_key(const uint16_t* weight,
                                int64_t padded_vocab_size, int64_t hidden_size,
                                const float* bias, int64_t vocab_size,
                                char* key, size_t key_len, char* error,
                                size_t error_len) {
  try {
    ClearError(error, error_len);
    detlogp::capi::BackendIdentity cpu;  // cpu_backend.cc's description
    cpu.backend = "cpu";
    cpu.instruction_set = detlogp::kernels::kCpuInstructionSet;
    cpu.kernel_version = detlogp::kernels::kCpuKernelVersion;
    return detlogp::capi::WriteDeterminismKey(cpu, weight, padded_vocab_size,
                                              hidden_size, bias, vocab_size,
                                              key, key_len, error, error_len);
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("internal error: ", e.what()), error, error_len);
  }
}

}  // extern "C"
