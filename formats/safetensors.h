// Reads and writes the .safetensors format: an 8-byte little-endian header
// length, a JSON header naming each tensor's dtype, shape and byte range, then
// the raw data. Only what this service needs: F32, BF16 and F16 tensors.
#ifndef DETLOGP_FORMATS_SAFETENSORS_H_
#define DETLOGP_FORMATS_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace detlogp::formats {

struct SafetensorInfo {
  std::string dtype;  // "F32", "BF16", "F16", ...
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // byte offsets into the data section
  uint64_t data_end = 0;
};

// The parsed header of a file; tensor data is read on demand.
class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  const std::map<std::string, SafetensorInfo>& tensors() const {
    return tensors_;
  }
  // Reads one tensor's bytes, checking that its size matches dtype and shape.
  absl::StatusOr<std::vector<uint8_t>> ReadTensor(
      const std::string& name) const;
  // Reads one tensor's `bytes` bytes (checked as ReadTensor does) into dst.
  absl::Status ReadTensorInto(const std::string& name, void* dst,
                              size_t bytes) const;

 private:
  absl::StatusOr<const SafetensorInfo*> CheckedTensor(
      const std::string& name) const;

  std::string path_;
  uint64_t data_offset_ = 0;  // where the data section starts in the file
  uint64_t file_size_ = 0;
  std::map<std::string, SafetensorInfo> tensors_;
};

// Parses a header JSON (exposed for tests and fuzzing).
absl::StatusOr<std::map<std::string, SafetensorInfo>> ParseSafetensorsHeader(
    const std::string& json);

struct SafetensorToWrite {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorToWrite>& tensors);

// Bytes per element of a safetensors dtype name, or 0 if unsupported.
int SafetensorDtypeSize(const std::string& dtype);

}  // namespace detlogp::formats

#endif  // DETLOGP_FORMATS_SAFETENSORS_H_
