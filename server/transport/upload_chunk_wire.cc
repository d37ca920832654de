#include "server/transport/upload_chunk_wire.h"

#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "detlogp/v1/detlogp.pb.h"
#include "proto/status_details.h"
#include "proto/wire_format.h"

namespace detlogp::server {
namespace {

constexpr uint64_t kChunkTag =
    v1::wire::Tag(detlogp::v1::UploadModelRequest::kChunkFieldNumber,
                  v1::wire::kLengthDelimited);
static_assert(kChunkTag < 0x80, "the chunk's tag is one byte on the wire");
constexpr int kMaxVarintBytes = 10;

// Reads forward, byte by byte, through consecutive pieces as through one
// buffer.
class PieceCursor {
 public:
  explicit PieceCursor(absl::Span<const absl::string_view> pieces)
      : pieces_(pieces) {}

  bool Next(uint8_t* byte) {
    SkipFinishedPieces();
    if (piece_ == pieces_.size()) return false;
    *byte = static_cast<uint8_t>(pieces_[piece_][offset_++]);
    ++position_;
    return true;
  }

  int64_t position() const { return position_; }

  // The bytes from here to the end, as spans of the pieces.
  std::vector<absl::string_view> Rest() {
    std::vector<absl::string_view> spans;
    SkipFinishedPieces();
    for (; piece_ < pieces_.size(); ++piece_, offset_ = 0) {
      const absl::string_view rest = pieces_[piece_].substr(offset_);
      if (!rest.empty()) spans.push_back(rest);
    }
    return spans;
  }

 private:
  void SkipFinishedPieces() {
    while (piece_ < pieces_.size() && offset_ == pieces_[piece_].size()) {
      ++piece_;
      offset_ = 0;
    }
  }

  const absl::Span<const absl::string_view> pieces_;
  size_t piece_ = 0;
  size_t offset_ = 0;
  int64_t position_ = 0;
};

absl::Status MalformedChunk(absl::string_view why) {
  return v1::FieldError(absl::StatusCode::kInvalidArgument, "chunk",
                        absl::StrCat(why, " (a malformed UploadModelRequest)"));
}

}  // namespace

absl::StatusOr<std::optional<UploadChunkSpans>> FindUploadChunk(
    absl::Span<const absl::string_view> pieces) {
  int64_t total = 0;
  for (absl::string_view piece : pieces) {
    total += static_cast<int64_t>(piece.size());
  }
  PieceCursor cursor(pieces);
  uint8_t byte = 0;
  if (!cursor.Next(&byte) || byte != kChunkTag) return std::nullopt;

  uint64_t length = 0;
  int length_bytes = 0;
  do {
    if (length_bytes == kMaxVarintBytes) {
      return MalformedChunk("its length runs past 10 bytes");
    }
    if (!cursor.Next(&byte)) {
      return MalformedChunk("the message ends inside its length");
    }
    // The tenth byte holds bit 63 alone.
    if (length_bytes == kMaxVarintBytes - 1 && (byte & 0x7fu) > 1) {
      return MalformedChunk("its length overflows 64 bits");
    }
    length |= uint64_t{byte & 0x7fu} << (7 * length_bytes);
    ++length_bytes;
  } while ((byte & 0x80u) != 0);

  const int64_t follow = total - cursor.position();
  if (length > static_cast<uint64_t>(follow)) {
    return MalformedChunk(absl::StrCat("its length is ", length, " bytes but ",
                                       follow, " bytes follow it"));
  }
  // A padded length (a last byte of 0 after others) parses the same, but a
  // typed forward would write it shorter: parsed whole, it is forwarded so.
  if (length_bytes > 1 && byte == 0) return std::nullopt;
  // Other fields follow the chunk: protobuf decides what they mean.
  if (length < static_cast<uint64_t>(follow)) return std::nullopt;

  UploadChunkSpans chunk;
  chunk.spans = cursor.Rest();
  chunk.size = static_cast<int64_t>(length);
  return chunk;
}

}  // namespace detlogp::server
