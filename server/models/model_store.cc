#include "server/models/model_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "spdlog/spdlog.h"

namespace detlogp::server {
namespace {

constexpr char kManifestName[] = "MANIFEST";
constexpr char kWeightsFileName[] = "lm_head.safetensors";
constexpr char kTempPrefix[] = ".tmp-";
constexpr char kUploadedWeightTensor[] = "lm_head.weight";
constexpr char kUploadedBiasTensor[] = "lm_head.bias";

absl::Status ErrnoStatus(absl::string_view what, const std::string& path) {
  return absl::InternalError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::StatusOr<std::string> RealPath(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) {
    return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  return std::string(resolved);
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::vector<std::string> ListDirectory(const std::string& path) {
  std::vector<std::string> names;
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return names;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(dir);
  return names;
}

absl::Status FsyncPath(const std::string& path, int flags) {
  const int fd = open(path.c_str(), flags);
  if (fd < 0) return ErrnoStatus("open", path);
  const int rc = fsync(fd);
  close(fd);
  return rc == 0 ? absl::OkStatus() : ErrnoStatus("fsync", path);
}

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (S_ISDIR(st.st_mode)) {
    for (const std::string& name : ListDirectory(path)) {
      if (absl::Status s = RemoveTree(absl::StrCat(path, "/", name)); !s.ok()) {
        return s;
      }
    }
    if (rmdir(path.c_str()) != 0) return ErrnoStatus("rmdir", path);
  } else if (unlink(path.c_str()) != 0) {
    return ErrnoStatus("unlink", path);
  }
  return absl::OkStatus();
}

absl::Status WriteFileSynced(const std::string& path, const std::string& text) {
  const int fd =
      open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("create", path);
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = write(fd, text.data() + written, text.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      close(fd);
      return ErrnoStatus("write", path);
    }
    written += static_cast<size_t>(n);
  }
  const int rc = fsync(fd);
  close(fd);
  return rc == 0 ? absl::OkStatus() : ErrnoStatus("fsync", path);
}

std::string ManifestText(const StoredVersion& stored, const std::string& root) {
  std::string relative = stored.source.path;
  if (absl::StartsWith(relative, root + "/"))
    relative = relative.substr(root.size() + 1);
  return absl::StrCat("format=detlogp-model-version-1\n",
                      "model=", stored.model, "\n", "version=", stored.version,
                      "\n", "path=", relative, "\n",
                      "lm_head_tensor=", stored.source.weight_tensor, "\n",
                      "bias_tensor=", stored.source.bias_tensor, "\n",
                      "vocab_size=", stored.source.vocab_size, "\n",
                      "weights_sha256=", stored.weights_sha256, "\n");
}

absl::StatusOr<StoredVersion> ParseManifest(const std::string& text) {
  StoredVersion stored;
  std::string format;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv =
        absl::StrSplit(line, absl::MaxSplits('=', 1));
    const std::string& key = kv.first;
    const std::string& value = kv.second;
    if (key == "format")
      format = value;
    else if (key == "model")
      stored.model = value;
    else if (key == "path")
      stored.source.path = value;
    else if (key == "lm_head_tensor")
      stored.source.weight_tensor = value;
    else if (key == "bias_tensor")
      stored.source.bias_tensor = value;
    else if (key == "weights_sha256")
      stored.weights_sha256 = value;
    else if (key == "version" && !absl::SimpleAtoi(value, &stored.version)) {
      return absl::DataLossError("bad version");
    } else if (key == "vocab_size" &&
               !absl::SimpleAtoi(value, &stored.source.vocab_size)) {
      return absl::DataLossError("bad vocab_size");
    }
  }
  if (format != "detlogp-model-version-1" || stored.source.path.empty() ||
      stored.weights_sha256.empty()) {
    return absl::DataLossError("incomplete manifest");
  }
  return stored;
}

// The 8-byte length and JSON header of a safetensors file holding the
// uploaded weight (and bias); the data follows in that order.
std::string SafetensorsPreamble(int64_t hidden_size, int64_t padded_vocab_size,
                                bool has_bias) {
  const uint64_t weight_bytes = padded_vocab_size * hidden_size * 2;
  std::string json =
      absl::StrCat("{\"", kUploadedWeightTensor,
                   "\":{\"dtype\":\"BF16\",\"shape\":[", padded_vocab_size, ",",
                   hidden_size, "],\"data_offsets\":[0,", weight_bytes, "]}");
  if (has_bias) {
    absl::StrAppend(&json, ",\"", kUploadedBiasTensor,
                    "\":{\"dtype\":\"F32\",\"shape\":[", padded_vocab_size,
                    "],\"data_offsets\":[", weight_bytes, ",",
                    weight_bytes + padded_vocab_size * 4, "]}");
  }
  json += "}";
  while (json.size() % 8 != 0) json += ' ';  // aligns the data section
  std::string preamble(8, '\0');
  uint64_t length = json.size();
  for (int i = 0; i < 8; ++i)
    preamble[i] = static_cast<char>(length >> (8 * i));
  return preamble + json;
}

}  // namespace

absl::Status ValidateModelName(absl::string_view name,
                               absl::string_view field) {
  const bool ok_length = !name.empty() && name.size() <= 64;
  bool ok_chars = ok_length && absl::ascii_isalnum(name[0]);
  for (char c : name) {
    ok_chars = ok_chars &&
               (absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-');
  }
  if (!ok_chars) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": model name '", name,
        "' must be 1-64 of [A-Za-z0-9._-] starting with a letter or digit"));
  }
  return absl::OkStatus();
}

VersionWriter::~VersionWriter() {
  if (fd_ >= 0) close(fd_);
  if (!committed_ && !temp_dir_.empty()) {
    if (absl::Status s = RemoveTree(temp_dir_); !s.ok()) {
      spdlog::warn("could not remove {}: {}", temp_dir_,
                   std::string(s.message()));
    }
  }
}

absl::Status VersionWriter::Append(const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = write(fd_, bytes, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("write", temp_dir_);
    }
    bytes += n;
    size -= static_cast<size_t>(n);
    written_ += n;
  }
  constexpr int64_t kWritebackBytes = 32 << 20;
  if (written_ - synced_ >= kWritebackBytes) {
    // Asynchronous: queues the range for writeback and returns.
    sync_file_range(fd_, synced_, written_ - synced_, SYNC_FILE_RANGE_WRITE);
    synced_ = written_;
  }
  return absl::OkStatus();
}

absl::Status VersionWriter::Commit(int64_t version,
                                   const std::string& weights_sha256) {
  if (fsync(fd_) != 0) return ErrnoStatus("fsync", temp_dir_);
  close(fd_);
  fd_ = -1;
  const std::string model_dir = absl::StrCat(root_, "/", model_);
  const std::string final_dir = absl::StrCat(model_dir, "/", version);
  StoredVersion stored;
  stored.model = model_;
  stored.version = version;
  stored.source.path = absl::StrCat(final_dir, "/", kWeightsFileName);
  stored.source.weight_tensor = kUploadedWeightTensor;
  stored.source.bias_tensor = has_bias_ ? kUploadedBiasTensor : "";
  stored.source.vocab_size = vocab_size_;
  stored.weights_sha256 = weights_sha256;
  if (absl::Status s =
          WriteFileSynced(absl::StrCat(temp_dir_, "/", kManifestName),
                          ManifestText(stored, root_));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = FsyncPath(temp_dir_, O_RDONLY | O_DIRECTORY); !s.ok())
    return s;
  if (rename(temp_dir_.c_str(), final_dir.c_str()) != 0) {
    return ErrnoStatus("rename", temp_dir_);
  }
  committed_ = true;
  return FsyncPath(model_dir, O_RDONLY | O_DIRECTORY);
}

absl::StatusOr<std::unique_ptr<ModelStore>> ModelStore::Open(
    const std::string& root) {
  auto canonical = RealPath(root);
  if (!canonical.ok() || !IsDirectory(*canonical)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model_root=", root, ": not an existing directory"));
  }
  const bool writable = access(canonical->c_str(), W_OK) == 0;
  auto store =
      std::unique_ptr<ModelStore>(new ModelStore(*canonical, writable));
  if (writable) {
    for (const std::string& model : ListDirectory(*canonical)) {
      const std::string model_dir = absl::StrCat(*canonical, "/", model);
      if (!IsDirectory(model_dir)) continue;
      for (const std::string& entry : ListDirectory(model_dir)) {
        if (!absl::StartsWith(entry, kTempPrefix)) continue;
        const std::string path = absl::StrCat(model_dir, "/", entry);
        spdlog::info("model root: removing an interrupted write {}", path);
        if (absl::Status s = RemoveTree(path); !s.ok()) {
          spdlog::warn("could not remove {}: {}", path,
                       std::string(s.message()));
        }
      }
    }
  }
  return store;
}

absl::StatusOr<std::string> ModelStore::ResolveInside(
    absl::string_view relative, absl::string_view field) const {
  if (relative.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": empty path"));
  }
  const auto denied = [&](absl::string_view why) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": '", relative, "' ", why,
                     "; paths are relative to --model_root"));
  };
  if (relative[0] == '/') return denied("is absolute");
  for (absl::string_view part : absl::StrSplit(relative, '/')) {
    if (part == "..") return denied("contains '..'");
  }
  const std::string joined = absl::StrCat(root_, "/", relative);
  auto resolved = RealPath(joined);
  if (!resolved.ok()) {
    return absl::NotFoundError(absl::StrCat(
        field, ": '", relative, "' does not exist under --model_root"));
  }
  // Symlinks are followed by realpath; the target must still be inside.
  if (!absl::StartsWith(*resolved, root_ + "/")) {
    return denied("leads outside the root through a symlink");
  }
  struct stat st;
  if (stat(resolved->c_str(), &st) != 0 ||
      !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode))) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": '", relative, "' is neither a file nor a directory"));
  }
  return *resolved;
}

std::map<std::string, std::vector<StoredVersion>> ModelStore::ListVersions()
    const {
  std::map<std::string, std::vector<StoredVersion>> out;
  for (const std::string& model : ListDirectory(root_)) {
    const std::string model_dir = absl::StrCat(root_, "/", model);
    if (!ValidateModelName(model, "dir").ok() || !IsDirectory(model_dir))
      continue;
    std::map<int64_t, StoredVersion> versions;
    for (const std::string& entry : ListDirectory(model_dir)) {
      int64_t version = 0;
      if (!absl::SimpleAtoi(entry, &version) || version <= 0) continue;
      const std::string manifest_path =
          absl::StrCat(model_dir, "/", entry, "/", kManifestName);
      std::ifstream in(manifest_path);
      std::stringstream text;
      text << in.rdbuf();
      auto stored = ParseManifest(text.str());
      if (!in || !stored.ok() || stored->model != model ||
          stored->version != version) {
        spdlog::warn("model root: skipping {}: unreadable manifest",
                     manifest_path);
        continue;
      }
      // Paths in manifests are relative to the root and must stay inside.
      auto path = ResolveInside(stored->source.path, "MANIFEST path");
      if (!path.ok()) {
        spdlog::warn("model root: skipping {}: {}", manifest_path,
                     std::string(path.status().message()));
        continue;
      }
      stored->source.path = *path;
      stored->source.confine_to = root_;
      versions.emplace(version, *std::move(stored));
    }
    for (auto& [version, stored] : versions)
      out[model].push_back(std::move(stored));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<VersionWriter>> ModelStore::BeginUpload(
    const std::string& model, int64_t hidden_size, int64_t vocab_size,
    int64_t padded_vocab_size, bool has_bias) {
  if (!writable_) {
    return absl::FailedPreconditionError(
        absl::StrCat("--model_root=", root_, " is not writable"));
  }
  auto writer = std::unique_ptr<VersionWriter>(new VersionWriter());
  writer->root_ = root_;
  writer->model_ = model;
  writer->vocab_size_ = vocab_size;
  writer->has_bias_ = has_bias;
  auto temp_dir = MakeTempVersionDir(model);
  if (!temp_dir.ok()) return temp_dir.status();
  writer->temp_dir_ = *std::move(temp_dir);
  const std::string file =
      absl::StrCat(writer->temp_dir_, "/", kWeightsFileName);
  writer->fd_ =
      open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (writer->fd_ < 0) return ErrnoStatus("create", file);
  const std::string preamble =
      SafetensorsPreamble(hidden_size, padded_vocab_size, has_bias);
  if (absl::Status s = writer->Append(preamble.data(), preamble.size());
      !s.ok()) {
    return s;
  }
  return writer;
}

absl::StatusOr<std::string> ModelStore::MakeTempVersionDir(
    const std::string& model) const {
  const std::string model_dir = absl::StrCat(root_, "/", model);
  if (mkdir(model_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus("mkdir", model_dir);
  }
  std::random_device random;
  const std::string temp_dir = absl::StrCat(
      model_dir, "/", kTempPrefix, absl::Hex(random()), absl::Hex(random()));
  if (mkdir(temp_dir.c_str(), 0755) != 0) return ErrnoStatus("mkdir", temp_dir);
  return temp_dir;
}

absl::Status ModelStore::RecordLoaded(const std::string& model, int64_t version,
                                      const LmHeadSource& source,
                                      const std::string& weights_sha256) {
  if (!writable_) return absl::OkStatus();  // serves, but not after a restart
  auto made = MakeTempVersionDir(model);
  if (!made.ok()) return made.status();
  const std::string& temp_dir = *made;
  const std::string model_dir = absl::StrCat(root_, "/", model);
  StoredVersion stored{model, version, source, weights_sha256};
  absl::Status s = WriteFileSynced(absl::StrCat(temp_dir, "/", kManifestName),
                                   ManifestText(stored, root_));
  if (s.ok()) s = FsyncPath(temp_dir, O_RDONLY | O_DIRECTORY);
  const std::string final_dir = absl::StrCat(model_dir, "/", version);
  if (s.ok() && rename(temp_dir.c_str(), final_dir.c_str()) != 0) {
    s = ErrnoStatus("rename", temp_dir);
  }
  if (!s.ok()) {
    RemoveTree(temp_dir).IgnoreError();
    return s;
  }
  return FsyncPath(model_dir, O_RDONLY | O_DIRECTORY);
}

absl::Status ModelStore::Remove(const std::string& model, int64_t version) {
  if (!writable_) return absl::OkStatus();
  return RemoveTree(absl::StrCat(root_, "/", model, "/", version));
}

}  // namespace detlogp::server
