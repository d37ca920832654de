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
  float sum_exp_z;     // sum of exp(z - partial.max) * z; entropy only
  int32_t top_count;   // candidates in the split's top list; top-k only
};

// One entry of a top-k list, kept in RanksBefore order.
struct TopCandidate {
  float z;
  int32_t id;
};

// Inserts (z, id) into `list` (sorted by RanksBefore, `*count` <= k entries)
// when it ranks among the k best; the displaced last entry drops out.
// Returns false when it does not rank, so a sorted source can stop early.
inline bool InsertCandidate(TopCandidate* list, int32_t* count, int32_t k,
                            float z, int32_t id) {
  int32_t n = *count;
  if (n == k) {
    if (!RanksBefore(z, id, list[k - 1].z, list[k - 1].id)) return false;
    n = k - 1;
  }
  int32_t i = n;
  while (i > 0 && RanksBefore(z, id, list[i - 1].z, list[i - 1].id)) {
    list[i] = list[i - 1];
    --i;
  }
  list[i] = TopCandidate{z, id};
  *count = n + 1;
  return true;
}

// One cell of the grid: rows [row_begin, row_begin + count) against one
// split. kEntropy and kTopK add their work to the same loop; with both off
// the loop is the logp-only one, so rows that ask for neither pay nothing.
// `tops` (kTopK only) holds each row's k-entry list for this split, k apart.
template <bool kEntropy, bool kTopK>
void ComputeCell(const LmHeadView& head, const LogpRowsView& rows,
                 const std::vector<float>& hidden_f32, int64_t row_begin,
                 int count, VocabRange range, SplitResult* results,
                 TopCandidate* tops) {
  const float* hidden[kRowBlock];
  for (int r = 0; r < count; ++r) {
    hidden[r] = hidden_f32.data() + (row_begin + r) * head.hidden_size;
    results[r].partial = {-std::numeric_limits<float>::infinity(), 0.0f};
    results[r].target_logit = 0.0f;
    results[r].sum_exp_z = 0.0f;
    results[r].top_count = 0;
  }
  float dots[kRowBlock];
  for (int64_t v = range.begin; v < range.end; ++v) {
    DotRows(hidden, count, head.weight + v * head.hidden_size, head.hidden_size,
            dots);
    const float bias = head.bias != nullptr ? head.bias[v] : 0.0f;
    for (int r = 0; r < count; ++r) {
      const float z = (dots[r] + bias) / rows.temperatures[row_begin + r];
      SoftmaxPartial& p = results[r].partial;
      // The sum_exp arithmetic is the logp-only kernel's, operation for
      // operation (one expf serves both sums), so lse bits do not depend on
      // whether entropy is computed.
      if (z > p.max) {
        const float scale = expf(p.max - z);
        p.sum_exp = p.sum_exp * scale + 1.0f;
        if constexpr (kEntropy) {
          results[r].sum_exp_z = results[r].sum_exp_z * scale + z;
        }
        p.max = z;
      } else {
        const float e = expf(z - p.max);
        p.sum_exp += e;
        if constexpr (kEntropy) results[r].sum_exp_z += e * z;
      }
      if constexpr (kTopK) {
        InsertCandidate(tops + r * rows.top_k, &results[r].top_count,
                        rows.top_k, z, static_cast<int32_t>(v));
      }
      if (v == rows.targets[row_begin + r]) results[r].target_logit = z;
    }
  }
}

using CellFn = void (*)(const LmHeadView&, const LogpRowsView&,
                        const std::vector<float>&, int64_t, int, VocabRange,
                        SplitResult*, TopCandidate*);

// Rows per grid pass when top-k lists are kept: bounds their scratch to
// kTopKPassRows * splits * k * 8 bytes (17 MiB at 132 splits, k = 32)
// whatever N is. Rows are independent, so passes change no bits.
constexpr int64_t kTopKPassRows = 512;

// Runs the (row block, split) grid over rows [pass_begin, pass_end) and
// folds each row's split partials in ascending split order.
void ComputePass(const LmHeadView& head, const LogpRowsView& rows,
                 const std::vector<float>& hidden_f32, int64_t pass_begin,
                 int64_t pass_end, ThreadPool* pool) {
  const bool entropy = rows.entropy != nullptr;
  const int32_t k = rows.top_k;
  const CellFn cell_fn =
      entropy
          ? (k > 0 ? &ComputeCell<true, true> : &ComputeCell<true, false>)
          : (k > 0 ? &ComputeCell<false, true> : &ComputeCell<false, false>);
  const int64_t pass_rows = pass_end - pass_begin;
  const int32_t splits = NumVocabSplits(head.vocab_size);
  const int64_t row_blocks = (pass_rows + kRowBlock - 1) / kRowBlock;
  // results[split][row], tops[split][row][k]
  std::vector<SplitResult> results(static_cast<size_t>(splits) * pass_rows);
  std::vector<TopCandidate> tops(static_cast<size_t>(splits) * pass_rows * k);
  auto cell = [&](int64_t index) {
    const int32_t split = static_cast<int32_t>(index % splits);
    const int64_t block_begin = (index / splits) * kRowBlock;
    const int count =
        static_cast<int>(std::min<int64_t>(kRowBlock, pass_rows - block_begin));
    const size_t slot = static_cast<size_t>(split) * pass_rows + block_begin;
    cell_fn(head, rows, hidden_f32, pass_begin + block_begin, count,
            VocabSplitRange(head.vocab_size, split), &results[slot],
            k > 0 ? &tops[slot * k] : nullptr);
  };
  if (pool != nullptr) {
    pool->ParallelFor(row_blocks * splits, cell);
  } else {
    for (int64_t i = 0; i < row_blocks * splits; ++i) cell(i);
  }

  std::vector<TopCandidate> merged(k);
  for (int64_t i = 0; i < pass_rows; ++i) {
    const int64_t r = pass_begin + i;
    // lse from the softmax states alone, as in the logp-only kernel; the
    // entropy sum rides along with the same rescaling.
    EntropyPartial acc{results[i].partial, results[i].sum_exp_z};
    for (int32_t s = 1; s < splits; ++s) {
      const SplitResult& next = results[s * pass_rows + i];
      const SoftmaxPartial combined =
          CombinePartials(acc.softmax, next.partial);
      if (entropy) {
        acc.sum_exp_z = CombineEntropySums(
            acc, EntropyPartial{next.partial, next.sum_exp_z}, combined.max);
      }
      acc.softmax = combined;
    }
    float target_logit = 0.0f;
    for (int32_t s = 0; s < splits; ++s) {
      const VocabRange range = VocabSplitRange(head.vocab_size, s);
      if (rows.targets[r] >= range.begin && rows.targets[r] < range.end) {
        target_logit = results[s * pass_rows + i].target_logit;
      }
    }
    const float lse = PartialLogSumExp(acc.softmax);
    rows.lse[r] = lse;
    rows.logprobs[r] = target_logit - lse;
    if (entropy) {
      rows.entropy[r] = PartialEntropy(acc.softmax, acc.sum_exp_z, lse);
    }
    if (k > 0) {
      // RanksBefore is a total order, so the k best of the union are the
      // same whatever order the split lists merge in; a fixed (ascending
      // split) order keeps even NaN rows reproducible.
      int32_t merged_count = 0;
      for (int32_t s = 0; s < splits; ++s) {
        const size_t slot = static_cast<size_t>(s) * pass_rows + i;
        const TopCandidate* list = &tops[slot * k];
        for (int32_t j = 0; j < results[slot].top_count; ++j) {
          // Each list is sorted: once one entry misses, the rest miss too.
          if (!InsertCandidate(merged.data(), &merged_count, k, list[j].z,
                               list[j].id)) {
            break;
          }
        }
      }
      for (int32_t j = 0; j < merged_count; ++j) {
        rows.top_ids[r * k + j] = merged[j].id;
        rows.top_logprobs[r * k + j] = merged[j].z - lse;
      }
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
  if (rows.rows > 0 && (rows.hidden == nullptr || rows.targets == nullptr ||
                        rows.temperatures == nullptr ||
                        rows.logprobs == nullptr || rows.lse == nullptr)) {
    return absl::InvalidArgumentError("rows: null buffer");
  }
  if (rows.top_k < 0 || rows.top_k > kMaxTopK || rows.top_k > head.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k: ", rows.top_k, " is outside [0, min(", kMaxTopK,
                     ", vocab_size=", head.vocab_size, ")]"));
  }
  if (rows.rows > 0 && rows.top_k > 0 &&
      (rows.top_ids == nullptr || rows.top_logprobs == nullptr)) {
    return absl::InvalidArgumentError("rows: top_k > 0 with a null top buffer");
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

  // One pass keeps the logp-only path exactly as it was; top-k lists bound
  // their scratch by going kTopKPassRows rows at a time.
  const int64_t pass_rows = rows.top_k > 0 ? kTopKPassRows : rows.rows;
  for (int64_t begin = 0; begin < rows.rows; begin += pass_rows) {
    ComputePass(head, rows, hidden_f32, begin,
                std::min(rows.rows, begin + pass_rows), pool);
  }
  return absl::OkStatus();
}

}  // namespace detlogp::kernels
