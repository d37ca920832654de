// The bytes of one served version as an upload carries them (the bf16
// weight, [padded_vocab_size, hidden_size] row-major, then the fp32 bias),
// for a peer that pulls the version (DownloadModel). Read from whatever the
// server holds, in this order:
//   1. the host copy, while the backend keeps one (the CPU backend does);
//   2. the placed model itself (LogpModel::ReadWeights: on a GPU, copied
//      back a chunk at a time, with no host copy of the whole head);
//   3. the version's files under --model_root (loaded, digest checked).
//
//   auto bytes = VersionBytes::Open(version, load_files);
//   (*bytes)->Read(offset, size, buffer);  // any range, in any order
#ifndef DETLOGP_SERVER_MODELS_VERSION_BYTES_H_
#define DETLOGP_SERVER_MODELS_VERSION_BYTES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"
#include "server/models/lm_head_weights.h"
#include "server/models/model_manager.h"

namespace detlogp::server {

class VersionBytes {
 public:
  // The version's weights from its files (empty: none).
  using FileLoader =
      std::function<absl::StatusOr<std::shared_ptr<const LmHeadWeights>>()>;

  // Where `version`'s bytes will be read from (it keeps what it reads
  // alive); FAILED_PRECONDITION naming model_version (reason
  // VERSION_UNAVAILABLE) when nothing the server holds can give them.
  static absl::StatusOr<std::unique_ptr<VersionBytes>> Open(
      const ServedVersion& version, const FileLoader& load_files);

  int64_t weight_bytes() const { return weight_bytes_; }
  int64_t total_bytes() const { return total_bytes_; }
  // "host copy", "device" (the placed model) or "files".
  const std::string& source() const { return source_; }
  // Bytes [offset, offset + size) into `out`.
  absl::Status Read(int64_t offset, int64_t size, char* out) const;

  // The whole of `version` (the one Open was given) as host weights: the
  // host copy itself when that is the source, else read into a new one
  // (a delta upload's base on a replica that keeps no host copy).
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> Weights(
      const ServedVersion& version) const;

 private:
  VersionBytes() = default;
  int64_t weight_bytes_ = 0;
  int64_t total_bytes_ = 0;
  std::string source_;
  // One of them is set.
  std::shared_ptr<const LmHeadWeights> host_;
  std::shared_ptr<const LogpModel> placed_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_MODELS_VERSION_BYTES_H_
