// Gradients of the H3 video input projection (CPU library; not served).
//
// dX[r][k] = sum_o dY[r][o] * W[o][k]. Per row, so batch invariant. Fixed
// order: the 5376 terms are cut into 42 chunks of kInputGradChunk=128 outputs;
// each chunk is one sequential fma chain from +0 in o order, and the chunk
// partials are added to a running total (from +0) in ascending chunk order:
//   total = 0; for c: { p = 0; for j < 128: p = fma(dy[128c+j], w[128c+j][k],
//   p);
//                       total = total + p; }
// The CUDA dX kernel uses the same order (tested bit-equal).
//
// dW[o][k] = sum_r dY[r][o] * X[r][k] and dbias[o] = sum_r dY[r][o] sum over
// rows, so their order must not depend on how rows are batched. Each row
// carries a caller-supplied logical key (int64 >= 0, unique). Fixed order, a
// function of the keys alone, in three levels:
//   chunk c      = keys [128c, 128c + 128): its partial is one sequential
//                  chain over its rows in ascending key order (fma for dW,
//                  add for dbias), from +0;
//   superchunk s = chunks [32s, 32s + 32) (4096 keys): its total adds the
//                  partials of its non-empty chunks in ascending order, from
//                  +0;
//   result       = the totals of the non-empty superchunks added in ascending
//                  order, from +0.
// The middle level lets a GPU compute superchunks in parallel and fold only
// R/4096 totals in order. Permuting rows or feeding them as micro-batches in
// any split gives identical bits.
//
// Memory stays bounded: the accumulator holds the totals, one chunk partial
// and only the rows of chunks it cannot fold yet. A chunk folds once it and
// all lower chunks are complete, which needs the key space (key_count); rows
// waiting beyond max_buffered_rows make Add fail with ResourceExhausted.
#ifndef DETLOGP_KERNELS_PROJECTION_GRAD_H_
#define DETLOGP_KERNELS_PROJECTION_GRAD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/projection.h"

namespace detlogp::kernels {

inline constexpr int64_t kInputGradChunk = 128;   // dX: outputs per chunk.
inline constexpr int64_t kRowKeyChunk = 128;      // dW/dbias: keys per chunk.
inline constexpr int64_t kRowKeySuperChunk = 32;  // chunks per superchunk.

// dx[rows][96] from dy[rows][5376] and weight[5376][96], in the order above.
absl::Status ProjectionInputGrad(absl::Span<const float> weight,
                                 absl::Span<const float> dy, int64_t rows,
                                 absl::Span<float> dx, int num_threads = 0);

struct ProjectionWeightGrads {
  std::vector<float> dweight;  // [5376][96]
  std::vector<float> dbias;    // [5376]
};

// Accumulates dW and dbias over micro-batches: Add(...) any number of times,
// then Finish() once.
class ProjectionGradAccumulator {
 public:
  struct Options {
    // > 0: every key lies in [0, key_count); a chunk folds as soon as it and
    // all lower chunks hold all their keys, so memory stays at a few chunks
    // when micro-batches arrive roughly in key order. 0: keys are any
    // int64 >= 0 and every row waits for Finish() (small batches only).
    int64_t key_count = 0;
    // Rows held for chunks that cannot fold yet (each 21.9 KB).
    int64_t max_buffered_rows = 32768;
    int num_threads = 0;  // 0: hardware concurrency.
  };

  static absl::StatusOr<std::unique_ptr<ProjectionGradAccumulator>> Create(
      const Options& options);
  ~ProjectionGradAccumulator();

  // dy: [rows][5376], x: [rows][96], keys: [rows]. On error the accumulator
  // is unchanged.
  absl::Status Add(absl::Span<const float> dy, absl::Span<const float> x,
                   absl::Span<const int64_t> keys);

  // Folds what is left, in ascending chunk order. Once only.
  absl::StatusOr<ProjectionWeightGrads> Finish();

  int64_t buffered_rows() const { return buffered_rows_; }

 private:
  struct PendingChunk {
    uint64_t seen[2] = {0, 0};  // bit (key - 128c): duplicate detection.
    std::vector<int64_t> keys;
    std::vector<float> dy;  // [n][5376]
    std::vector<float> x;   // [n][96]
  };

  explicit ProjectionGradAccumulator(const Options& options);
  int64_t ChunkSize(int64_t chunk) const;
  void FoldChunk(int64_t index, const PendingChunk& chunk);
  void FoldReadyPrefix();

  Options options_;
  std::map<int64_t, PendingChunk> pending_;  // by chunk index
  int64_t folded_below_ = 0;  // chunks < this are folded (key_count > 0)
  int64_t buffered_rows_ = 0;
  bool finished_ = false;
  struct State;  // totals, superchunk total, one chunk's partial (~6 MB)
  std::unique_ptr<State> state_;
};

// One-shot: the same bits as one accumulator fed these rows in any split.
absl::StatusOr<ProjectionWeightGrads> ComputeProjectionWeightGrads(
    absl::Span<const float> dy, absl::Span<const float> x,
    absl::Span<const int64_t> keys, int num_threads = 0);

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_PROJECTION_GRAD_H_
