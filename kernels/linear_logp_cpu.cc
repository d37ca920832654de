#include "kernels/linear_logp_cpu.h"

#include <math.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/bfloat16.h"
#include "kernels/softmax_partial.h"
#include "kernels/split_policy.h"

namespace detlogp::kernels {
namespace {

constexpr int kDotLanes = 16;
// Rows that share each weight-row load; only a speed knob, never a bits knob.
constexpr int kRowBlock = 4;

using Lanes = std::array<float, kDotLanes>;

// Folds 16 lanes with a fixed pairwise tree: 8 sums of neighbours, then 4,
// 2, 1.
inline float FoldLanes(Lanes lanes) {
  for (int width = kDotLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] = lanes[2 * i] + lanes[2 * i + 1];
  }
  return lanes[0];
}

// Dot products of `count` rows (count <= kRowBlock) with one weight row. Each
// row's arithmetic is the same whatever `count` is.
inline void DotRows(const float* const* hidden, int count,
                    const uint16_t* weight_row, int64_t hidden_size,
                    float* out) {
  Lanes acc[kRowBlock] = {};
  const int64_t body = hidden_size - hidden_size % kDotLanes;
  for (int64_t k = 0; k < body; k += kDotLanes) {
    float w[kDotLanes];
    for (int l = 0; l < kDotLanes; ++l) w[l] = Bf16ToFloat(weight_row[k + l]);
    for (int r = 0; r < count; ++r) {
      const float* h = hidden[r] + k;
      for (int l = 0; l < kDotLanes; ++l) acc[r][l] += h[l] * w[l];
    }
  }
  for (int64_t k = body; k < hidden_size; ++k) {
    const float w = Bf16ToFloat(weight_row[k]);
    for (int r = 0; r < count; ++r) acc[r][k % kDotLanes] += hidden[r][k] * w;
  }
  for (int r = 0; r < count; ++r) out[r] = FoldLanes(acc[r]);
}

struct SplitResult {
  SoftmaxPartial partial;
  float target_logit;  // meaningful only in the split holding the target
};

// One cell of the grid: rows [row_begin, row_begin + count) against one split.
void ComputeCell(const LmHeadView& head, const LogpRowsView& rows,
                 const std::vector<float>& hidden_f32, int64_t row_begin,
                 int count, VocabRange range, SplitResult* results) {
  const float* hidden[kRowBlock];
  for (int r = 0; r < count; ++r) {
    hidden[r] = hidden_f32.data() + (row_begin + r) * head.hidden_size;
    results[r].partial = {-std::numeric_limits<float>::infinity(), 0.0f};
    results[r].target_logit = 0.0f;
  }
  float dots[kRowBlock];
  for (int64_t v = range.begin; v < range.end; ++v) {
    DotRows(hidden, count, head.weight + v * head.hidden_size, head.hidden_size,
            dots);
    const float bias = head.bias != nullptr ? head.bias[v] : 0.0f;
    for (int r = 0; r < count; ++r) {
      const float z = (dots[r] + bias) / rows.temperatures[row_begin + r];
      SoftmaxPartial& p = results[r].partial;
      if (z > p.max) {
        p.sum_exp = p.sum_exp * expf(p.max - z) + 1.0f;
        p.max = z;
      } else {
        p.sum_exp += expf(z - p.max);
      }
      if (v == rows.targets[row_begin + r]) results[r].target_logit = z;
    }
  }
}

}  // namespace

absl::Status ValidateLinearLogpViews(const LmHeadView& head,
                                     const LogpRowsView& rows) {
  if (head.hidden_size <= 0 || head.vocab_size <= 0 ||
      head.padded_vocab_size < head.vocab_size || head.weight == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lm_head: bad shape H=", head.hidden_size, " V=", head.vocab_size,
        " V_pad=", head.padded_vocab_size));
  }
  if (rows.rows < 0) {
    return absl::InvalidArgumentError("rows: negative row count");
  }
  if (rows.rows > 0 &&
      (rows.hidden == nullptr || rows.targets == nullptr ||
       rows.temperatures == nullptr || rows.logprobs == nullptr ||
       rows.lse == nullptr)) {
    return absl::InvalidArgumentError("rows: null buffer");
  }
  return absl::OkStatus();
}

absl::Status ComputeLinearLogpCpu(const LmHeadView& head,
                                  const LogpRowsView& rows, ThreadPool* pool) {
  if (absl::Status s = ValidateLinearLogpViews(head, rows); !s.ok()) return s;
  if (rows.rows == 0) return absl::OkStatus();
  for (int64_t r = 0; r < rows.rows; ++r) {
    if (rows.targets[r] < 0 || rows.targets[r] >= head.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("target_ids[", r, "] = ", rows.targets[r],
                       " is outside [0, ", head.vocab_size, ")"));
    }
  }

  std::vector<float> hidden_f32(rows.rows * head.hidden_size);
  for (size_t i = 0; i < hidden_f32.size(); ++i) {
    hidden_f32[i] = Bf16ToFloat(rows.hidden[i]);
  }

  const int32_t splits = NumVocabSplits(head.vocab_size);
  const int64_t row_blocks = (rows.rows + kRowBlock - 1) / kRowBlock;
  // results[split][row]
  std::vector<SplitResult> results(static_cast<size_t>(splits) * rows.rows);
  auto cell = [&](int64_t index) {
    const int32_t split = static_cast<int32_t>(index % splits);
    const int64_t row_begin = (index / splits) * kRowBlock;
    const int count =
        static_cast<int>(std::min<int64_t>(kRowBlock, rows.rows - row_begin));
    ComputeCell(head, rows, hidden_f32, row_begin, count,
                VocabSplitRange(head.vocab_size, split),
                &results[split * rows.rows + row_begin]);
  };
  if (pool != nullptr) {
    pool->ParallelFor(row_blocks * splits, cell);
  } else {
    for (int64_t i = 0; i < row_blocks * splits; ++i) cell(i);
  }

  for (int64_t r = 0; r < rows.rows; ++r) {
    SoftmaxPartial total = results[r].partial;
    for (int32_t s = 1; s < splits; ++s) {
      total = CombinePartials(total, results[s * rows.rows + r].partial);
    }
    float target_logit = 0.0f;
    for (int32_t s = 0; s < splits; ++s) {
      const VocabRange range = VocabSplitRange(head.vocab_size, s);
      if (rows.targets[r] >= range.begin && rows.targets[r] < range.end) {
        target_logit = results[s * rows.rows + r].target_logit;
      }
    }
    const float lse = PartialLogSumExp(total);
    rows.lse[r] = lse;
    rows.logprobs[r] = target_logit - lse;
  }
  return absl::OkStatus();
}

}  // namespace detlogp::kernels
