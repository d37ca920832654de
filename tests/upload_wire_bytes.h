// Bytes for the upload wire tests: a chunk whose every byte differs from its
// neighbours (a misplaced or dropped byte shows), and the serialized message
// that carries one.
#ifndef DETLOGP_TESTS_UPLOAD_WIRE_BYTES_H_
#define DETLOGP_TESTS_UPLOAD_WIRE_BYTES_H_

#include <cstddef>
#include <string>

#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::server {

inline std::string Pattern(size_t size) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i * 131 + 7);
  return bytes;
}

// What protobuf writes for an UploadModelRequest holding just `chunk`.
inline std::string ChunkMessage(const std::string& chunk) {
  detlogp::v1::UploadModelRequest message;
  message.set_chunk(chunk);
  return message.SerializeAsString();
}

}  // namespace detlogp::server

#endif  // DETLOGP_TESTS_UPLOAD_WIRE_BYTES_H_
