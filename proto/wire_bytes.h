// Pieces of the protobuf wire format, for messages whose large bytes field
// is sent or received in place instead of through a std::string copy: the
// server's ProjectResponse (Y lent from its chunk buffer) and the client's
// ProjectRequest (X lent from the caller's rows).
#ifndef DETLOGP_PROTO_WIRE_BYTES_H_
#define DETLOGP_PROTO_WIRE_BYTES_H_

#include <cstdint>
#include <string>

namespace detlogp::wire {

inline void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// The key of a length-delimited field (wire type 2); its length follows as
// a varint, then its bytes.
inline void AppendBytesFieldKey(int field_number, std::string* out) {
  AppendVarint((static_cast<uint64_t>(field_number) << 3) | 2, out);
}

}  // namespace detlogp::wire

#endif  // DETLOGP_PROTO_WIRE_BYTES_H_
