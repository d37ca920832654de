#include "client/project_chunk.h"

#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace detlogp::client {
namespace {

// Protobuf wire types (https://protobuf.dev/programming-guides/encoding/).
enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLength = 2,
  kFixed32 = 5
};

// Reads the protobuf wire format across a message's slices. Every read is
// bounded by `limit` (the end of the message, or of the nested message being
// read); running past it is a DATA_LOSS naming the field.
class WireReader {
 public:
  explicit WireReader(const std::vector<grpc::Slice>& slices)
      : slices_(slices) {
    for (const grpc::Slice& s : slices_)
      size_ += static_cast<int64_t>(s.size());
    Settle();
  }

  int64_t position() const { return position_; }
  int64_t size() const { return size_; }

  absl::Status ReadVarint(absl::string_view field, int64_t limit,
                          uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (position_ >= limit) {
        return Malformed(field, "a varint runs past the end of its message");
      }
      const uint8_t byte = Current();
      Advance(1);
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return absl::OkStatus();
    }
    return Malformed(field, "a varint longer than 10 bytes");
  }

  // A length prefix, checked to fit before `limit`.
  absl::Status ReadLength(absl::string_view field, int64_t limit,
                          int64_t* length) {
    uint64_t value = 0;
    if (absl::Status s = ReadVarint(field, limit, &value); !s.ok()) return s;
    const int64_t left = limit - position_;
    if (value > static_cast<uint64_t>(left)) {
      return Malformed(
          field,
          absl::StrCat("length ", value, " runs past the end of its message (",
                       left, " bytes left)"));
    }
    *length = static_cast<int64_t>(value);
    return absl::OkStatus();
  }

  // The next `length` bytes (already checked to fit), copied.
  void Copy(int64_t length, std::string* out) {
    out->clear();
    out->reserve(static_cast<size_t>(length));
    ForEachPiece(length, [&](absl::string_view piece) {
      out->append(piece.data(), piece.size());
    });
  }

  // The next `length` bytes (already checked to fit), as views into the
  // slices.
  void View(int64_t length, std::vector<absl::string_view>* out) {
    out->clear();
    ForEachPiece(length,
                 [&](absl::string_view piece) { out->push_back(piece); });
  }

  void Skip(int64_t length) {
    ForEachPiece(length, [](absl::string_view) {});
  }

  // Skips a field of an unknown number.
  absl::Status SkipField(absl::string_view field, uint32_t wire_type,
                         int64_t limit) {
    int64_t length = 0;
    switch (wire_type) {
      case kVarint: {
        uint64_t ignored;
        return ReadVarint(field, limit, &ignored);
      }
      case kFixed64:
        length = 8;
        break;
      case kFixed32:
        length = 4;
        break;
      case kLength:
        if (absl::Status s = ReadLength(field, limit, &length); !s.ok())
          return s;
        break;
      default:
        return Malformed(field,
                         absl::StrCat("unsupported wire type ", wire_type));
    }
    if (length > limit - position_) {
      return Malformed(field, "runs past the end of its message");
    }
    Skip(length);
    return absl::OkStatus();
  }

  static absl::Status Malformed(absl::string_view field,
                                absl::string_view why) {
    return absl::DataLossError(absl::StrCat(field, ": ", why));
  }

 private:
  uint8_t Current() const {
    return static_cast<uint8_t>(slices_[slice_].begin()[offset_]);
  }

  template <typename F>
  void ForEachPiece(int64_t length, F&& f) {
    while (length > 0) {
      const grpc::Slice& s = slices_[slice_];
      const int64_t n = std::min<int64_t>(length, s.size() - offset_);
      f(absl::string_view(reinterpret_cast<const char*>(s.begin()) + offset_,
                          static_cast<size_t>(n)));
      Advance(n);
      length -= n;
    }
  }

  // Callers never advance past size_.
  void Advance(int64_t n) {
    offset_ += static_cast<size_t>(n);
    position_ += n;
    Settle();
  }

  // Moves past finished (and empty) slices.
  void Settle() {
    while (slice_ < slices_.size() && offset_ >= slices_[slice_].size()) {
      offset_ = 0;
      ++slice_;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
  int64_t position_ = 0;
  int64_t size_ = 0;
};

// The tag of the next field: its number and wire type.
absl::Status ReadTag(WireReader& in, absl::string_view message, int64_t limit,
                     uint32_t* number, uint32_t* wire_type) {
  uint64_t tag = 0;
  if (absl::Status s = in.ReadVarint(message, limit, &tag); !s.ok()) return s;
  *number = static_cast<uint32_t>(tag >> 3);
  *wire_type = static_cast<uint32_t>(tag & 7);
  if (*number == 0 || (tag >> 3) > 0x1fffffff) {
    return WireReader::Malformed(message,
                                 absl::StrCat("field number ", tag >> 3));
  }
  return absl::OkStatus();
}

absl::Status ExpectWireType(absl::string_view field, uint32_t got,
                            uint32_t want) {
  if (got == want) return absl::OkStatus();
  return WireReader::Malformed(
      field, absl::StrCat("wire type ", got, " where ", want, " belongs"));
}

// y (a Tensor) between the reader's position and `limit`, merged into
// `chunk` as protobuf merges a repeated message field: scalars replaced,
// shape appended.
absl::Status ParseY(WireReader& in, int64_t limit, ProjectChunk* chunk) {
  while (in.position() < limit) {
    uint32_t number = 0, wire_type = 0;
    if (absl::Status s =
            ReadTag(in, "ProjectResponse.y", limit, &number, &wire_type);
        !s.ok()) {
      return s;
    }
    switch (number) {
      case 1: {  // dtype
        if (absl::Status s =
                ExpectWireType("ProjectResponse.y.dtype", wire_type, kVarint);
            !s.ok()) {
          return s;
        }
        uint64_t value = 0;
        if (absl::Status s =
                in.ReadVarint("ProjectResponse.y.dtype", limit, &value);
            !s.ok()) {
          return s;
        }
        chunk->y_dtype =
            static_cast<detlogp::v1::DType>(static_cast<int32_t>(value));
        break;
      }
      case 2: {  // shape: packed, or one element
        constexpr absl::string_view kField = "ProjectResponse.y.shape";
        uint64_t value = 0;
        if (wire_type == kVarint) {
          if (absl::Status s = in.ReadVarint(kField, limit, &value); !s.ok())
            return s;
          chunk->y_shape.push_back(static_cast<int64_t>(value));
          break;
        }
        if (absl::Status s = ExpectWireType(kField, wire_type, kLength);
            !s.ok())
          return s;
        int64_t length = 0;
        if (absl::Status s = in.ReadLength(kField, limit, &length); !s.ok())
          return s;
        const int64_t end = in.position() + length;
        while (in.position() < end) {
          if (absl::Status s = in.ReadVarint(kField, end, &value); !s.ok())
            return s;
          chunk->y_shape.push_back(static_cast<int64_t>(value));
        }
        break;
      }
      case 3: {  // data
        constexpr absl::string_view kField = "ProjectResponse.y.data";
        if (absl::Status s = ExpectWireType(kField, wire_type, kLength);
            !s.ok())
          return s;
        int64_t length = 0;
        if (absl::Status s = in.ReadLength(kField, limit, &length); !s.ok())
          return s;
        in.View(length, &chunk->y_data);
        chunk->y_data_bytes = length;
        break;
      }
      default:
        if (absl::Status s =
                in.SkipField(absl::StrCat("ProjectResponse.y field ", number),
                             wire_type, limit);
            !s.ok()) {
          return s;
        }
    }
  }
  return absl::OkStatus();
}

}  // namespace

void ProjectChunk::CopyYTo(void* destination) const {
  char* out = static_cast<char*>(destination);
  for (absl::string_view piece : y_data) {
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  }
}

detlogp::v1::ProjectResponse ProjectChunk::ToProto() const {
  detlogp::v1::ProjectResponse response;
  response.set_request_id(request_id);
  response.set_row_offset(row_offset);
  detlogp::v1::Tensor* y = response.mutable_y();
  y->set_dtype(y_dtype);
  for (int64_t d : y_shape) y->add_shape(d);
  std::string* data = y->mutable_data();
  data->resize(static_cast<size_t>(y_data_bytes));
  CopyYTo(data->data());
  response.set_determinism_key(determinism_key);
  return response;
}

absl::StatusOr<ProjectChunk> ParseProjectChunk(
    const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  if (grpc::Status status = message.Dump(&slices); !status.ok()) {
    return absl::DataLossError(absl::StrCat(
        "ProjectResponse: unreadable message: ", status.error_message()));
  }
  return ParseProjectChunk(std::move(slices));
}

absl::StatusOr<ProjectChunk> ParseProjectChunk(
    std::vector<grpc::Slice> slices) {
  ProjectChunk chunk;
  // The views point into the vector's elements (inlined slices keep their
  // bytes inside grpc_slice): move the vector in first, then read it there.
  chunk.slices = std::move(slices);
  WireReader in(chunk.slices);
  const int64_t end = in.size();
  while (in.position() < end) {
    uint32_t number = 0, wire_type = 0;
    if (absl::Status s =
            ReadTag(in, "ProjectResponse", end, &number, &wire_type);
        !s.ok()) {
      return s;
    }
    switch (number) {
      case 1:
      case 4: {  // request_id, determinism_key
        const absl::string_view field = number == 1
                                            ? "ProjectResponse.request_id"
                                            : "ProjectResponse.determinism_key";
        if (absl::Status s = ExpectWireType(field, wire_type, kLength); !s.ok())
          return s;
        int64_t length = 0;
        if (absl::Status s = in.ReadLength(field, end, &length); !s.ok())
          return s;
        in.Copy(length,
                number == 1 ? &chunk.request_id : &chunk.determinism_key);
        break;
      }
      case 2: {  // row_offset
        constexpr absl::string_view kField = "ProjectResponse.row_offset";
        if (absl::Status s = ExpectWireType(kField, wire_type, kVarint);
            !s.ok())
          return s;
        uint64_t value = 0;
        if (absl::Status s = in.ReadVarint(kField, end, &value); !s.ok())
          return s;
        chunk.row_offset = static_cast<int64_t>(value);
        break;
      }
      case 3: {  // y
        constexpr absl::string_view kField = "ProjectResponse.y";
        if (absl::Status s = ExpectWireType(kField, wire_type, kLength);
            !s.ok())
          return s;
        int64_t length = 0;
        if (absl::Status s = in.ReadLength(kField, end, &length); !s.ok())
          return s;
        if (absl::Status s = ParseY(in, in.position() + length, &chunk);
            !s.ok())
          return s;
        break;
      }
      default:
        if (absl::Status s = in.SkipField(
                absl::StrCat("ProjectResponse field ", number), wire_type, end);
            !s.ok()) {
          return s;
        }
    }
  }
  return std::move(chunk);  // the vector's elements, and so y_data, stay put
}

}  // namespace detlogp::client
