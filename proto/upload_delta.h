// The delta encoding of UploadModel (UPLOAD_ENCODING_XOR_ZSTD): one zstd
// frame whose content is the bytewise XOR of the new payload (weight bytes,
// then bias bytes) with the base version's payload. Bits that did not change
// are zero bytes, which zstd squeezes to almost nothing; the receiver XORs
// the frame's content with its base again, so the result is bit-exact by
// construction and needs no index format.
//
//   // Pusher: the whole delta in memory, compressed on `threads` threads.
//   auto delta = EncodeXorDelta({new_weight, new_bias}, {old_weight,
//                               old_bias}, {.threads = 8});
//
//   // Replica: compressed chunks in, rebuilt payload bytes out, in order.
//   XorDeltaDecoder decoder(base_parts, total_bytes);
//   decoder.Feed(chunk.data(), chunk.size(), sink);  // sink(bytes, n)
//   decoder.Finish();  // the frame ended exactly at total_bytes
//
// The frame carries zstd's content checksum: a corrupted delta fails here
// (DATA_LOSS naming `chunk`) or, at the latest, at the full digest check.
#ifndef DETLOGP_PROTO_UPLOAD_DELTA_H_
#define DETLOGP_PROTO_UPLOAD_DELTA_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace detlogp::v1 {

// Payload bytes as consecutive parts (weight, then bias); the same layout on
// both sides of an XOR.
using PayloadParts = std::vector<absl::string_view>;

struct XorDeltaOptions {
  // zstd's compression level; 1 is the fastest and, on XOR deltas, within a
  // few percent of level 3's size.
  int compression_level = 1;
  // zstd worker threads; 0 compresses on the caller's thread.
  int threads = 0;
  // Bytes XORed and handed to zstd at a time.
  int64_t block_bytes = 16 << 20;
};

// The compressed XOR of `updated` with `base` (equal total sizes, else
// INVALID_ARGUMENT naming `base`).
absl::StatusOr<std::string> EncodeXorDelta(const PayloadParts& updated,
                                           const PayloadParts& base,
                                           const XorDeltaOptions& options = {});

// The most bytes a delta of a `payload_bytes` payload may take (zstd's
// bound on an incompressible input).
int64_t MaxXorDeltaBytes(int64_t payload_bytes);

// Decodes a delta frame arriving in pieces against `base` (which must
// outlive the decoder) and hands the rebuilt payload to a sink in order.
class XorDeltaDecoder {
 public:
  using Sink = std::function<absl::Status(const char* bytes, size_t size)>;

  XorDeltaDecoder(PayloadParts base, int64_t total_bytes);
  ~XorDeltaDecoder();
  XorDeltaDecoder(const XorDeltaDecoder&) = delete;
  XorDeltaDecoder& operator=(const XorDeltaDecoder&) = delete;

  int64_t decoded_bytes() const { return decoded_; }

  // The next compressed bytes. DATA_LOSS naming `chunk` when they are not a
  // valid frame, or decode past total_bytes; a sink's error is returned.
  absl::Status Feed(const char* data, size_t size, const Sink& sink);
  // OK when the frame is complete (its checksum checked) and rebuilt
  // exactly total_bytes; DATA_LOSS naming `chunk` otherwise.
  absl::Status Finish() const;

 private:
  // XORs `size` decoded bytes with the base at offset decoded_, in place.
  void XorWithBase(char* bytes, size_t size) const;

  const PayloadParts base_;
  const int64_t total_bytes_;
  struct State;
  std::unique_ptr<State> state_;  // zstd's context and output buffer
  int64_t decoded_ = 0;
  bool frame_complete_ = false;
};

}  // namespace detlogp::v1

#endif  // DETLOGP_PROTO_UPLOAD_DELTA_H_
