// The operator's --model_root on disk: where LoadModel may read files, and
// where model versions are kept so a restarted server serves them again.
//
// Layout (TensorFlow Serving's base_path/<name>/<version>):
//   <root>/<name>/<version>/MANIFEST          what to load, and its digest
//   <root>/<name>/<version>/lm_head.safetensors  uploaded weights
//   <root>/<name>/.tmp-<nonce>/               a version being written
// A version directory appears only by rename(2) of a complete, fsynced
// temporary one, so a directory named by a number is always complete; a
// crash mid-write leaves only a .tmp- directory, removed at the next start.
//
// Paths a client sends are resolved inside the root: "..", absolute paths
// and symlinks that lead out of it are PERMISSION_DENIED.
#ifndef DETLOGP_SERVER_MODELS_MODEL_STORE_H_
#define DETLOGP_SERVER_MODELS_MODEL_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/models/lm_head_weights.h"

namespace detlogp::server {

// Model names are directory names: 1-64 of [A-Za-z0-9._-], starting with a
// letter or digit. INVALID_ARGUMENT naming `field` otherwise.
absl::Status ValidateModelName(absl::string_view name, absl::string_view field);

// What a version directory's MANIFEST records.
struct StoredVersion {
  std::string model;
  int64_t version = 0;
  LmHeadSource source;  // path absolute (resolved inside the root)
  std::string weights_sha256;
};

// Streams an upload into a temporary version directory: the safetensors
// header first (shapes are known from the upload's header), then the bytes
// as they arrive. Commit() fsyncs and renames; destroying an uncommitted
// writer removes the temporary directory.
class VersionWriter {
 public:
  ~VersionWriter();
  VersionWriter(const VersionWriter&) = delete;
  VersionWriter& operator=(const VersionWriter&) = delete;

  // Writes the next bytes; starts writeback every few MiB so that Commit's
  // fsync has little left to do.
  absl::Status Append(const void* data, size_t size);
  // Fsyncs the file, writes the MANIFEST, renames the directory to
  // `version` and fsyncs the model directory.
  absl::Status Commit(int64_t version, const std::string& weights_sha256);

 private:
  friend class ModelStore;
  VersionWriter() = default;

  std::string root_;
  std::string model_;
  std::string temp_dir_;
  int64_t vocab_size_ = 0;
  int64_t written_ = 0;
  int64_t synced_ = 0;  // bytes whose writeback has been started
  bool has_bias_ = false;
  int fd_ = -1;
  bool committed_ = false;
};

class ModelStore {
 public:
  // `root` must be an existing directory. Removes temporary directories a
  // crash left behind.
  static absl::StatusOr<std::unique_ptr<ModelStore>> Open(
      const std::string& root);

  const std::string& root() const { return root_; }
  bool writable() const { return writable_; }

  // Resolves a client-sent path (relative to the root) to an existing file
  // or checkpoint directory inside the root. `field` names the request
  // field. (Files a checkpoint directory leads to are confined to the root
  // when they are read: LmHeadSource::confine_to.)
  absl::StatusOr<std::string> ResolveInside(absl::string_view relative,
                                            absl::string_view field) const;

  // Every complete version on disk, by model name, versions ascending.
  // Unreadable manifests are skipped and logged.
  std::map<std::string, std::vector<StoredVersion>> ListVersions() const;

  // Starts writing an uploaded version of shape [padded_vocab, hidden] bf16
  // (+ fp32 bias); its number is given at Commit.
  absl::StatusOr<std::unique_ptr<VersionWriter>> BeginUpload(
      const std::string& model, int64_t hidden_size, int64_t vocab_size,
      int64_t padded_vocab_size, bool has_bias);

  // Records a version loaded from a file already under the root: only a
  // MANIFEST naming it (no copy of the weights).
  absl::Status RecordLoaded(const std::string& model, int64_t version,
                            const LmHeadSource& source,
                            const std::string& weights_sha256);

  // Removes a version's directory (no-op when absent).
  absl::Status Remove(const std::string& model, int64_t version);

 private:
  // Creates <root>/<model>/.tmp-<nonce>/.
  absl::StatusOr<std::string> MakeTempVersionDir(
      const std::string& model) const;

  explicit ModelStore(std::string root, bool writable)
      : root_(std::move(root)), writable_(writable) {}

  std::string root_;  // canonical, no trailing slash
  bool writable_ = false;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_MODELS_MODEL_STORE_H_
