#include "formats/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include <cctype>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/parallel_for.h"

namespace detlogp::formats {
namespace {

// Headers above this are refused: real ones are kilobytes.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// A small recursive-descent reader for the subset of JSON a header uses:
// objects, arrays, strings, integers. Values under "__metadata__" (a string
// map) are read and dropped.
class HeaderReader {
 public:
  explicit HeaderReader(const std::string& text) : text_(text) {}

  absl::StatusOr<std::map<std::string, SafetensorInfo>> Read() {
    std::map<std::string, SafetensorInfo> tensors;
    if (!Consume('{')) return Error("expected '{'");
    if (Consume('}')) return tensors;
    do {
      std::string name;
      if (!ReadString(&name)) return Error("expected a tensor name");
      if (!Consume(':')) return Error("expected ':'");
      if (name == "__metadata__") {
        if (!SkipValue(0)) return Error("bad __metadata__");
        continue;
      }
      SafetensorInfo info;
      if (absl::Status s = ReadTensorInfo(&info); !s.ok()) return s;
      if (!tensors.emplace(name, std::move(info)).second) {
        return Error(absl::StrCat("duplicate tensor '", name, "'"));
      }
    } while (Consume(','));
    if (!Consume('}')) return Error("expected '}'");
    SkipSpace();
    if (pos_ != text_.size()) return Error("trailing bytes after header");
    return tensors;
  }

 private:
  absl::Status ReadTensorInfo(SafetensorInfo* info) {
    if (!Consume('{')) return Error("expected a tensor object");
    bool has_dtype = false, has_shape = false, has_offsets = false;
    do {
      std::string key;
      if (!ReadString(&key)) return Error("expected a key");
      if (!Consume(':')) return Error("expected ':'");
      if (key == "dtype") {
        if (!ReadString(&info->dtype)) return Error("dtype: expected a string");
        has_dtype = true;
      } else if (key == "shape") {
        if (!ReadIntArray(&info->shape)) return Error("shape: expected ints");
        has_shape = true;
      } else if (key == "data_offsets") {
        std::vector<int64_t> offsets;
        if (!ReadIntArray(&offsets) || offsets.size() != 2 || offsets[0] < 0 ||
            offsets[1] < offsets[0]) {
          return Error("data_offsets: expected [begin, end]");
        }
        info->data_begin = offsets[0];
        info->data_end = offsets[1];
        has_offsets = true;
      } else if (!SkipValue(0)) {
        return Error(absl::StrCat("bad value for '", key, "'"));
      }
    } while (Consume(','));
    if (!Consume('}')) return Error("expected '}' after tensor");
    if (!has_dtype || !has_shape || !has_offsets) {
      return Error("tensor lacks dtype, shape or data_offsets");
    }
    for (int64_t dim : info->shape) {
      if (dim < 0) return Error("negative dimension");
    }
    return absl::OkStatus();
  }

  bool ReadIntArray(std::vector<int64_t>* out) {
    if (!Consume('[')) return false;
    if (Consume(']')) return true;
    do {
      int64_t value;
      if (!ReadInt(&value)) return false;
      out->push_back(value);
    } while (Consume(','));
    return Consume(']');
  }

  bool ReadInt(int64_t* value) {
    SkipSpace();
    bool negative = false;
    if (pos_ < text_.size() && text_[pos_] == '-') {
      negative = true;
      ++pos_;
    }
    if (pos_ >= text_.size() ||
        !isdigit(static_cast<unsigned char>(text_[pos_]))) {
      return false;
    }
    uint64_t magnitude = 0;
    while (pos_ < text_.size() &&
           isdigit(static_cast<unsigned char>(text_[pos_]))) {
      const uint64_t digit = text_[pos_++] - '0';
      if (magnitude > (std::numeric_limits<int64_t>::max() - digit) / 10) {
        return false;
      }
      magnitude = magnitude * 10 + digit;
    }
    *value = negative ? -static_cast<int64_t>(magnitude)
                      : static_cast<int64_t>(magnitude);
    return true;
  }

  bool ReadString(std::string* out) {
    if (!Consume('"')) return false;
    out->clear();
    while (pos_ < text_.size()) {
      const char c = text_[pos_++];
      if (c == '"') return true;
      if (c == '\\') {
        if (pos_ >= text_.size()) return false;
        const char escaped = text_[pos_++];
        if (escaped == 'u') {
          if (pos_ + 4 > text_.size()) return false;
          pos_ += 4;  // names here are ASCII; keep a placeholder
          out->push_back('?');
        } else {
          out->push_back(escaped == 'n'   ? '\n'
                         : escaped == 't' ? '\t'
                                          : escaped);
        }
      } else {
        out->push_back(c);
      }
    }
    return false;
  }

  // Skips any JSON value; `depth` bounds nesting against hostile input.
  bool SkipValue(int depth) {
    if (depth > 64) return false;
    SkipSpace();
    if (pos_ >= text_.size()) return false;
    const char c = text_[pos_];
    if (c == '"') {
      std::string ignored;
      return ReadString(&ignored);
    }
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++pos_;
      if (Consume(close)) return true;
      do {
        if (c == '{') {
          std::string key;
          if (!ReadString(&key) || !Consume(':')) return false;
        }
        if (!SkipValue(depth + 1)) return false;
      } while (Consume(','));
      return Consume(close);
    }
    // Numbers, true, false, null.
    const size_t start = pos_;
    while (pos_ < text_.size() &&
           (isalnum(static_cast<unsigned char>(text_[pos_])) ||
            text_[pos_] == '-' || text_[pos_] == '+' || text_[pos_] == '.')) {
      ++pos_;
    }
    return pos_ > start;
  }

  void SkipSpace() {
    while (pos_ < text_.size() &&
           isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }

  bool Consume(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors header: ", what, " at byte ", pos_));
  }

  const std::string& text_;
  size_t pos_ = 0;
};

}  // namespace

int SafetensorDtypeSize(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  if (dtype == "F64" || dtype == "I64") return 8;
  return 0;
}

absl::StatusOr<std::map<std::string, SafetensorInfo>> ParseSafetensorsHeader(
    const std::string& json) {
  return HeaderReader(json).Read();
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  SafetensorsFile file;
  file.path_ = path;
  file.file_size_ = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  uint8_t length_bytes[8];
  if (file.file_size_ < 8 ||
      !in.read(reinterpret_cast<char*>(length_bytes), 8)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": too short"));
  }
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i)
    header_size = (header_size << 8) | length_bytes[i];
  if (header_size > kMaxHeaderBytes || header_size > file.file_size_ - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", header_size, " is invalid"));
  }
  std::string header(header_size, '\0');
  if (!in.read(header.data(), header_size)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated header"));
  }
  auto tensors = ParseSafetensorsHeader(header);
  if (!tensors.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", tensors.status().message()));
  }
  file.data_offset_ = 8 + header_size;
  for (const auto& [name, info] : *tensors) {
    if (info.data_end > file.file_size_ - file.data_offset_) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", name, "' runs past the end of the file"));
    }
  }
  file.tensors_ = *std::move(tensors);
  return file;
}

absl::StatusOr<const SafetensorInfo*> SafetensorsFile::CheckedTensor(
    const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat(path_, ": no tensor named '", name, "'"));
  }
  const SafetensorInfo& info = it->second;
  const int element_size = SafetensorDtypeSize(info.dtype);
  if (element_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": tensor '", name, "' has unsupported dtype ", info.dtype));
  }
  uint64_t elements = 1;
  for (int64_t dim : info.shape) elements *= static_cast<uint64_t>(dim);
  if (elements * element_size != info.data_end - info.data_begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": tensor '", name, "' byte range does not match its shape"));
  }
  return &info;
}

absl::Status SafetensorsFile::ReadTensorInto(const std::string& name, void* dst,
                                             size_t bytes) const {
  auto info = CheckedTensor(name);
  if (!info.ok()) return info.status();
  if ((*info)->data_end - (*info)->data_begin != bytes) {
    return absl::InternalError(
        absl::StrCat(path_, ": '", name, "' is not ", bytes, " bytes"));
  }
  const int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path_, ": cannot open"));
  // Ranges read on several threads: one thread reads a cached file at a
  // few GB/s, a 1.2 GB lm_head takes several times less on eight.
  constexpr uint64_t kRangeBytes = 64 << 20;
  const uint64_t base = data_offset_ + (*info)->data_begin;
  const int64_t ranges =
      static_cast<int64_t>((bytes + kRangeBytes - 1) / kRangeBytes);
  std::atomic<bool> failed{false};
  kernels::ParallelForRanges(ranges, 8, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last && !failed; ++r) {
      uint64_t done = r * kRangeBytes;
      const uint64_t end = std::min<uint64_t>(bytes, done + kRangeBytes);
      while (done < end) {
        const ssize_t n = pread(fd, static_cast<char*>(dst) + done, end - done,
                                static_cast<off_t>(base + done));
        if (n <= 0) {
          if (n < 0 && errno == EINTR) continue;
          failed = true;
          break;
        }
        done += static_cast<uint64_t>(n);
      }
    }
  });
  close(fd);
  if (failed)
    return absl::DataLossError(
        absl::StrCat(path_, ": cannot read '", name, "'"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> SafetensorsFile::ReadTensor(
    const std::string& name) const {
  auto info = CheckedTensor(name);
  if (!info.ok()) return info.status();
  std::vector<uint8_t> data((*info)->data_end - (*info)->data_begin);
  if (absl::Status s = ReadTensorInto(name, data.data(), data.size()); !s.ok())
    return s;
  return data;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorToWrite>& tensors) {
  std::string header = "{";
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorToWrite& t = tensors[i];
    absl::StrAppend(&header, i == 0 ? "" : ",", "\"", t.name,
                    "\":{\"dtype\":\"", t.dtype, "\",\"shape\":[");
    for (size_t d = 0; d < t.shape.size(); ++d) {
      absl::StrAppend(&header, d == 0 ? "" : ",", t.shape[d]);
    }
    absl::StrAppend(&header, "],\"data_offsets\":[", offset, ",",
                    offset + t.data.size(), "]}");
    offset += t.data.size();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  uint8_t length_bytes[8];
  for (int i = 0; i < 8; ++i)
    length_bytes[i] = (header.size() >> (8 * i)) & 0xff;
  out.write(reinterpret_cast<const char*>(length_bytes), 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const SafetensorToWrite& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.data.data()),
              static_cast<std::streamsize>(t.data.size()));
  }
  if (!out) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace detlogp::formats
