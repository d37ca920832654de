#include "kernels/projection_grad.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"

namespace detlogp::kernels {
namespace {

constexpr int64_t kK = kProjectionInDim;
constexpr int64_t kN = kProjectionOutDim;
constexpr int64_t kWeightSize = kN * kK;

// Totals and scratch for the keyed dW/dbias order (see the header).
struct WeightGradState {
  std::vector<float> dweight, dbias;                  // running totals
  std::vector<float> super_dweight, super_dbias;      // current superchunk
  std::vector<float> partial_dweight, partial_dbias;  // one chunk's partial
  int64_t current_super = -1;  // superchunk held in super_*; -1: none
  WeightGradState()
      : dweight(kWeightSize, 0.f),
        dbias(kN, 0.f),
        super_dweight(kWeightSize, 0.f),
        super_dbias(kN, 0.f),
        partial_dweight(kWeightSize),
        partial_dbias(kN) {}
};

// total += superchunk total; superchunk total = 0, for outputs [o_begin,
// o_end).
void FlushSuperRange(WeightGradState& s, int64_t o_begin, int64_t o_end) {
  for (int64_t i = o_begin * kK; i < o_end * kK; ++i) {
    s.dweight[i] = s.dweight[i] + s.super_dweight[i];
    s.super_dweight[i] = 0.f;
  }
  for (int64_t o = o_begin; o < o_end; ++o) {
    s.dbias[o] = s.dbias[o] + s.super_dbias[o];
    s.super_dbias[o] = 0.f;
  }
}

// Folds the superchunk in progress into the totals (at the end).
void FlushSuper(WeightGradState& s, int num_threads) {
  if (s.current_super < 0) return;
  ParallelForRanges(kN, num_threads,
                    [&](int64_t b, int64_t e) { FlushSuperRange(s, b, e); });
  s.current_super = -1;
}

// Folds key chunk `chunk` (chunks arrive in ascending order; rows already in
// ascending key order): rows -> partial -> superchunk total, flushing the
// previous superchunk first. Threads split the outputs o, never the rows, so
// every output keeps its sequential order.
void FoldRows(const std::vector<const float*>& dy_rows,
              const std::vector<const float*>& x_rows, int64_t chunk,
              int num_threads, WeightGradState& s) {
  const int64_t n = static_cast<int64_t>(dy_rows.size());
  const int64_t super = chunk / kRowKeySuperChunk;
  const bool flush = s.current_super >= 0 && s.current_super != super;
  ParallelForRanges(kN, num_threads, [&](int64_t o_begin, int64_t o_end) {
    if (flush) FlushSuperRange(s, o_begin, o_end);
    float* pw = s.partial_dweight.data();
    float* pb = s.partial_dbias.data();
    std::fill(pw + o_begin * kK, pw + o_end * kK, 0.f);
    std::fill(pb + o_begin, pb + o_end, 0.f);
    for (int64_t r = 0; r < n; ++r) {
      const float* dy = dy_rows[r];
      const float* x = x_rows[r];
      for (int64_t o = o_begin; o < o_end; ++o) {
        const float d = dy[o];
        float* p = pw + o * kK;
        for (int64_t k = 0; k < kK; ++k) p[k] = std::fma(d, x[k], p[k]);
        pb[o] = pb[o] + d;
      }
    }
    float* sw = s.super_dweight.data();
    float* sb = s.super_dbias.data();
    for (int64_t i = o_begin * kK; i < o_end * kK; ++i) sw[i] = sw[i] + pw[i];
    for (int64_t o = o_begin; o < o_end; ++o) sb[o] = sb[o] + pb[o];
  });
  s.current_super = super;
}

absl::Status CheckRowSpans(absl::Span<const float> dy,
                           absl::Span<const float> x, int64_t rows) {
  if (static_cast<int64_t>(dy.size()) != rows * kN) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dy must have rows*", kN, "=", rows * kN, " floats, got ", dy.size()));
  }
  if (static_cast<int64_t>(x.size()) != rows * kK) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x must have rows*", kK, "=", rows * kK, " floats, got ", x.size()));
  }
  return absl::OkStatus();
}

// Row indices sorted by key; error on a negative, out-of-range or repeated
// key. key_count <= 0 means no upper bound.
absl::StatusOr<std::vector<int64_t>> SortedRowOrder(
    absl::Span<const int64_t> keys, int64_t key_count) {
  std::vector<int64_t> order(keys.size());
  std::iota(order.begin(), order.end(), 0);
  for (int64_t key : keys) {
    if (key < 0 || (key_count > 0 && key >= key_count)) {
      return absl::InvalidArgumentError(
          absl::StrCat("row key ", key, " outside [0, ",
                       key_count > 0 ? absl::StrCat(key_count) : "inf", ")"));
    }
  }
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  for (size_t i = 1; i < order.size(); ++i) {
    if (keys[order[i]] == keys[order[i - 1]]) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate row key ", keys[order[i]]));
    }
  }
  return order;
}

}  // namespace

absl::Status ProjectionInputGrad(absl::Span<const float> weight,
                                 absl::Span<const float> dy, int64_t rows,
                                 absl::Span<float> dx, int num_threads) {
  if (static_cast<int64_t>(weight.size()) != kWeightSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight must have ", kWeightSize, " floats, got ", weight.size()));
  }
  if (rows < 0 || rows > kProjectionMaxRows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows must be in [0, kProjectionMaxRows=", kProjectionMaxRows,
        "], got ", rows));
  }
  if (static_cast<int64_t>(dy.size()) != rows * kN) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dy must have rows*", kN, "=", rows * kN, " floats, got ", dy.size()));
  }
  if (static_cast<int64_t>(dx.size()) != rows * kK) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dx must have rows*", kK, "=", rows * kK, " floats, got ", dx.size()));
  }
  static_assert(kN % kInputGradChunk == 0, "chunks must tile the outputs");
  ParallelForRanges(rows, num_threads, [&](int64_t begin, int64_t end) {
    float partial[kK];
    for (int64_t r = begin; r < end; ++r) {
      const float* dyr = dy.data() + r * kN;
      float* total = dx.data() + r * kK;
      std::fill(total, total + kK, 0.f);
      for (int64_t c = 0; c < kN; c += kInputGradChunk) {
        std::fill(partial, partial + kK, 0.f);
        for (int64_t o = c; o < c + kInputGradChunk; ++o) {
          const float d = dyr[o];
          const float* w = weight.data() + o * kK;
          for (int64_t k = 0; k < kK; ++k) {
            partial[k] = std::fma(d, w[k], partial[k]);
          }
        }
        for (int64_t k = 0; k < kK; ++k) total[k] = total[k] + partial[k];
      }
    }
  });
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Accumulator.

struct ProjectionGradAccumulator::State : WeightGradState {};

ProjectionGradAccumulator::ProjectionGradAccumulator(const Options& options)
    : options_(options), state_(std::make_unique<State>()) {}

ProjectionGradAccumulator::~ProjectionGradAccumulator() = default;

absl::StatusOr<std::unique_ptr<ProjectionGradAccumulator>>
ProjectionGradAccumulator::Create(const Options& options) {
  if (options.key_count < 0) {
    return absl::InvalidArgumentError("key_count must be >= 0");
  }
  if (options.max_buffered_rows < kRowKeyChunk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_buffered_rows must be >= ", kRowKeyChunk, " (one key chunk)"));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError("num_threads must be >= 0");
  }
  return std::unique_ptr<ProjectionGradAccumulator>(
      new ProjectionGradAccumulator(options));
}

int64_t ProjectionGradAccumulator::ChunkSize(int64_t chunk) const {
  if (options_.key_count <= 0) return -1;  // unknown: never complete early
  return std::min(kRowKeyChunk, options_.key_count - chunk * kRowKeyChunk);
}

void ProjectionGradAccumulator::FoldChunk(int64_t index,
                                          const PendingChunk& chunk) {
  const int64_t n = static_cast<int64_t>(chunk.keys.size());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return chunk.keys[a] < chunk.keys[b];
  });
  std::vector<const float*> dy_rows(n), x_rows(n);
  for (int64_t i = 0; i < n; ++i) {
    dy_rows[i] = chunk.dy.data() + order[i] * kN;
    x_rows[i] = chunk.x.data() + order[i] * kK;
  }
  FoldRows(dy_rows, x_rows, index, options_.num_threads, *state_);
}

void ProjectionGradAccumulator::FoldReadyPrefix() {
  while (!pending_.empty() && pending_.begin()->first == folded_below_ &&
         static_cast<int64_t>(pending_.begin()->second.keys.size()) ==
             ChunkSize(folded_below_)) {
    FoldChunk(pending_.begin()->first, pending_.begin()->second);
    buffered_rows_ -=
        static_cast<int64_t>(pending_.begin()->second.keys.size());
    pending_.erase(pending_.begin());
    ++folded_below_;
  }
}

absl::Status ProjectionGradAccumulator::Add(absl::Span<const float> dy,
                                            absl::Span<const float> x,
                                            absl::Span<const int64_t> keys) {
  if (finished_) {
    return absl::FailedPreconditionError("Add after Finish");
  }
  const int64_t rows = static_cast<int64_t>(keys.size());
  if (absl::Status st = CheckRowSpans(dy, x, rows); !st.ok()) return st;
  absl::StatusOr<std::vector<int64_t>> order =
      SortedRowOrder(keys, options_.key_count);
  if (!order.ok()) return order.status();

  // Validate everything, and simulate the folding, before changing state.
  std::map<int64_t, int64_t> new_counts;  // chunk -> rows added
  for (int64_t key : keys) {
    const int64_t c = key / kRowKeyChunk;
    const int64_t bit = key - c * kRowKeyChunk;
    auto it = pending_.find(c);
    const bool seen =
        c < folded_below_ || (it != pending_.end() &&
                              ((it->second.seen[bit / 64] >> (bit % 64)) & 1));
    if (seen) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate row key ", key, " (already accumulated)"));
    }
    ++new_counts[c];
  }
  int64_t remaining = buffered_rows_ + rows;
  for (int64_t c = folded_below_;; ++c) {
    auto it = pending_.find(c);
    auto nt = new_counts.find(c);
    const int64_t have =
        (it == pending_.end() ? 0
                              : static_cast<int64_t>(it->second.keys.size())) +
        (nt == new_counts.end() ? 0 : nt->second);
    if (have == 0 || have != ChunkSize(c)) break;
    remaining -= have;
  }
  if (remaining > options_.max_buffered_rows) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "projection grad accumulator would buffer ", remaining,
        " rows > max_buffered_rows=", options_.max_buffered_rows,
        "; set key_count and feed micro-batches in ascending key order, or "
        "raise max_buffered_rows"));
  }

  for (int64_t r : *order) {
    const int64_t key = keys[r];
    const int64_t c = key / kRowKeyChunk;
    const int64_t bit = key - c * kRowKeyChunk;
    PendingChunk& chunk = pending_[c];
    chunk.seen[bit / 64] |= uint64_t{1} << (bit % 64);
    chunk.keys.push_back(key);
    chunk.dy.insert(chunk.dy.end(), dy.begin() + r * kN,
                    dy.begin() + (r + 1) * kN);
    chunk.x.insert(chunk.x.end(), x.begin() + r * kK, x.begin() + (r + 1) * kK);
  }
  buffered_rows_ += rows;
  FoldReadyPrefix();
  return absl::OkStatus();
}

absl::StatusOr<ProjectionWeightGrads> ProjectionGradAccumulator::Finish() {
  if (finished_) return absl::FailedPreconditionError("Finish called twice");
  finished_ = true;
  for (auto& [c, chunk] : pending_) FoldChunk(c, chunk);  // ascending order
  pending_.clear();
  FlushSuper(*state_, options_.num_threads);
  buffered_rows_ = 0;
  ProjectionWeightGrads out;
  out.dweight = std::move(state_->dweight);
  out.dbias = std::move(state_->dbias);
  return out;
}

absl::StatusOr<ProjectionWeightGrads> ComputeProjectionWeightGrads(
    absl::Span<const float> dy, absl::Span<const float> x,
    absl::Span<const int64_t> keys, int num_threads) {
  const int64_t rows = static_cast<int64_t>(keys.size());
  if (absl::Status st = CheckRowSpans(dy, x, rows); !st.ok()) return st;
  if (num_threads < 0) {
    return absl::InvalidArgumentError("num_threads must be >= 0");
  }
  absl::StatusOr<std::vector<int64_t>> order = SortedRowOrder(keys, 0);
  if (!order.ok()) return order.status();
  // Walk the rows in key order, folding each key chunk straight from the
  // caller's memory (no copies).
  WeightGradState s;
  std::vector<const float*> dy_rows, x_rows;
  for (size_t i = 0; i < order->size();) {
    const int64_t c = keys[(*order)[i]] / kRowKeyChunk;
    dy_rows.clear();
    x_rows.clear();
    for (; i < order->size() && keys[(*order)[i]] / kRowKeyChunk == c; ++i) {
      dy_rows.push_back(dy.data() + (*order)[i] * kN);
      x_rows.push_back(x.data() + (*order)[i] * kK);
    }
    FoldRows(dy_rows, x_rows, c, num_threads, s);
  }
  FlushSuper(s, num_threads);
  ProjectionWeightGrads out;
  out.dweight = std::move(s.dweight);
  out.dbias = std::move(s.dbias);
  return out;
}

}  // namespace detlogp::kernels
