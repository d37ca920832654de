// The protobuf wire format, as far as detlogp's own readers and writers of
// LogProbRequest need it: the server reads a request's rows where gRPC
// received them (server/transport/request_wire.h) and the C++ client writes
// them straight into gRPC's buffer (client/logp_client.h). Field numbers
// come from the generated code (LogProbRequest::kHiddenFieldNumber, ...).
#ifndef DETLOGP_PROTO_WIRE_FORMAT_H_
#define DETLOGP_PROTO_WIRE_FORMAT_H_

#include <cstdint>
#include <string>

namespace detlogp::v1::wire {

// A field's tag is (field_number << 3) | wire type.
enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kFixed32 = 5,
};

constexpr uint64_t Tag(uint32_t field_number, WireType type) {
  return (uint64_t{field_number} << 3) | type;
}

inline void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

}  // namespace detlogp::v1::wire

#endif  // DETLOGP_PROTO_WIRE_FORMAT_H_
