#include "server/transport/request_wire.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "proto/wire_format.h"

namespace detlogp::server {
namespace {

using v1::wire::AppendVarint;
using v1::wire::kFixed32;
using v1::wire::kFixed64;
using v1::wire::kLengthDelimited;
using v1::wire::kVarint;
using v1::wire::Tag;

constexpr uint64_t kHiddenTag =
    Tag(v1::LogProbRequest::kHiddenFieldNumber, kLengthDelimited);
constexpr uint64_t kDataTag =
    Tag(v1::Tensor::kDataFieldNumber, kLengthDelimited);

// Reads forward through consecutive chunks as through one buffer; every
// read is bounded by an `end` position it may not pass.
class ChunkReader {
 public:
  explicit ChunkReader(absl::Span<const absl::string_view> chunks)
      : chunks_(chunks) {
    starts_.reserve(chunks.size() + 1);
    int64_t at = 0;
    for (absl::string_view chunk : chunks) {
      starts_.push_back(at);
      at += static_cast<int64_t>(chunk.size());
    }
    starts_.push_back(at);
  }

  int64_t size() const { return starts_.back(); }
  int64_t position() const { return position_; }

  bool ReadVarint(int64_t end, uint64_t* value) {
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (position_ >= end) return false;
      const uint8_t byte = NextByte();
      result |= uint64_t{byte & 0x7fu} << shift;
      if ((byte & 0x80u) == 0) {
        *value = result;
        return true;
      }
    }
    return false;
  }

  // A length that fits before `end`.
  bool ReadLength(int64_t end, int64_t* length) {
    uint64_t value;
    if (!ReadVarint(end, &value) ||
        value > static_cast<uint64_t>(end - position_)) {
      return false;
    }
    *length = static_cast<int64_t>(value);
    return true;
  }

  bool Skip(int64_t count, int64_t end) {
    if (count < 0 || count > end - position_) return false;
    position_ += count;
    return true;
  }

  // Moves past a field's value of `wire_type` (groups are not read here).
  bool SkipValue(uint64_t wire_type, int64_t end) {
    uint64_t ignored;
    int64_t length;
    switch (wire_type) {
      case kVarint:
        return ReadVarint(end, &ignored);
      case kFixed64:
        return Skip(8, end);
      case kLengthDelimited:
        return ReadLength(end, &length) && Skip(length, end);
      case kFixed32:
        return Skip(4, end);
      default:
        return false;
    }
  }

  // Calls `piece` with the bytes [from, to), chunk by chunk.
  template <typename Piece>
  void ForEachPiece(int64_t from, int64_t to, Piece piece) const {
    size_t chunk = std::upper_bound(starts_.begin(), starts_.end(), from) -
                   starts_.begin() - 1;
    while (from < to) {
      const int64_t offset = from - starts_[chunk];
      const int64_t take =
          std::min<int64_t>(to, starts_[chunk + 1]) - starts_[chunk] - offset;
      if (take > 0) piece(chunks_[chunk].substr(offset, take));
      from += std::max<int64_t>(take, 0);
      ++chunk;
    }
  }

 private:
  uint8_t NextByte() {
    while (position_ >= starts_[chunk_ + 1]) ++chunk_;
    const uint8_t byte =
        static_cast<uint8_t>(chunks_[chunk_][position_ - starts_[chunk_]]);
    ++position_;
    return byte;
  }

  const absl::Span<const absl::string_view> chunks_;
  std::vector<int64_t> starts_;  // chunk i holds [starts_[i], starts_[i+1])
  size_t chunk_ = 0;             // the chunk holding position_, or before it
  int64_t position_ = 0;
};

}  // namespace

std::optional<SplitLogProbRequest> SplitHiddenData(
    absl::Span<const absl::string_view> chunks) {
  ChunkReader in(chunks);
  const int64_t end = in.size();
  const auto append_to = [](std::string* out) {
    return [out](absl::string_view piece) {
      out->append(piece.data(), piece.size());
    };
  };
  SplitLogProbRequest split;
  std::string header;  // the message less hidden.data
  bool seen_hidden = false;
  bool seen_data = false;
  while (in.position() < end) {
    const int64_t field_start = in.position();
    uint64_t tag;
    if (!in.ReadVarint(end, &tag)) return std::nullopt;
    if (tag != kHiddenTag) {
      if (!in.SkipValue(tag & 7, end)) return std::nullopt;
      in.ForEachPiece(field_start, in.position(), append_to(&header));
      continue;
    }
    int64_t tensor_bytes;
    if (seen_hidden || !in.ReadLength(end, &tensor_bytes)) return std::nullopt;
    seen_hidden = true;
    const int64_t tensor_end = in.position() + tensor_bytes;
    std::string tensor;  // the Tensor less data
    while (in.position() < tensor_end) {
      const int64_t inner_start = in.position();
      uint64_t inner_tag;
      if (!in.ReadVarint(tensor_end, &inner_tag)) return std::nullopt;
      if (inner_tag != kDataTag) {
        if (!in.SkipValue(inner_tag & 7, tensor_end)) return std::nullopt;
        in.ForEachPiece(inner_start, in.position(), append_to(&tensor));
        continue;
      }
      int64_t data_bytes;
      if (seen_data || !in.ReadLength(tensor_end, &data_bytes)) {
        return std::nullopt;
      }
      seen_data = true;
      in.ForEachPiece(
          in.position(), in.position() + data_bytes,
          [&split](absl::string_view piece) { split.data.push_back(piece); });
      split.data_bytes = data_bytes;
      in.Skip(data_bytes, tensor_end);
    }
    AppendVarint(tag, &header);
    AppendVarint(tensor.size(), &header);
    header += tensor;
  }
  if (!seen_data || !split.header.ParseFromString(header)) return std::nullopt;
  return split;
}

}  // namespace detlogp::server
