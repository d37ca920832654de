// The rows of one projection spread over several calls, block by block:
// block b (rows [b * block_rows, (b + 1) * block_rows) of the request) goes
// on call b % calls, and each call's x holds its blocks' rows in block
// order. With rows_per_chunk = block_rows every chunk a call answers is one
// whole block, so the answers go back into row order while each call has
// only a few chunks ahead of the slowest: one gRPC stream is read on one
// thread, several run side by side (docs/performance.md, "H3 projection
// streaming").
// Only the request's last block can be short, and it is its call's last.
#ifndef DETLOGP_CLIENT_INTERLEAVED_ROWS_H_
#define DETLOGP_CLIENT_INTERLEAVED_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace detlogp::client {

class InterleavedRows {
 public:
  // At most `max_calls` calls, fewer when there are fewer blocks (one at
  // least); rows >= 0, block_rows > 0.
  InterleavedRows(int64_t rows, int64_t block_rows, int max_calls)
      : rows_(rows),
        block_rows_(block_rows),
        blocks_((rows + block_rows - 1) / block_rows),
        calls_(static_cast<int>(
            std::max<int64_t>(1, std::min<int64_t>(max_calls, blocks_)))) {}

  int64_t rows() const { return rows_; }
  int64_t block_rows() const { return block_rows_; }
  int64_t blocks() const { return blocks_; }
  int calls() const { return calls_; }
  int CallOfBlock(int64_t block) const {
    return static_cast<int>(block % calls_);
  }

  // Rows of block `block` (block_rows but for a short last block).
  int64_t BlockRows(int64_t block) const {
    return std::min(block_rows_, rows_ - block * block_rows_);
  }

  // Rows call `call` carries.
  int64_t CallRows(int call) const {
    int64_t total = 0;
    for (int64_t b = call; b < blocks_; b += calls_) total += BlockRows(b);
    return total;
  }

  // The request's row for row `call_row` of call `call`'s x.
  int64_t RequestRow(int call, int64_t call_row) const {
    const int64_t nth_block = call_row / block_rows_;
    return (call + nth_block * calls_) * block_rows_ + call_row % block_rows_;
  }

  // Call `call`'s x: its blocks' rows of `x` ([rows, row_floats]), in order.
  std::vector<float> GatherCallRows(const float* x, int64_t row_floats,
                                    int call) const {
    std::vector<float> out(static_cast<size_t>(CallRows(call) * row_floats));
    float* next = out.data();
    for (int64_t b = call; b < blocks_; b += calls_) {
      const int64_t floats = BlockRows(b) * row_floats;
      std::memcpy(next, x + b * block_rows_ * row_floats,
                  static_cast<size_t>(floats) * sizeof(float));
      next += floats;
    }
    return out;
  }

 private:
  int64_t rows_;
  int64_t block_rows_;
  int64_t blocks_;
  int calls_;
};

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_INTERLEAVED_ROWS_H_
