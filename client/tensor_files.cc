#include "client/tensor_files.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "formats/safetensors.h"

namespace detlogp::client {
namespace {

// Returns the text between `key`'s quotes-and-colon and the next delimiter.
std::string NpyHeaderValue(const std::string& header, const std::string& key,
                           char open, char close) {
  const size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) return "";
  const size_t begin = header.find(open, at + key.size() + 2);
  if (begin == std::string::npos) return "";
  const size_t end = header.find(close, begin + 1);
  if (end == std::string::npos) return "";
  return header.substr(begin + 1, end - begin - 1);
}

absl::Status SetElements(const std::string& type, std::string bytes,
                         LoadedTensor* tensor) {
  if (type == "F32") {
    tensor->dtype = detlogp::v1::DTYPE_FLOAT32;
  } else if (type == "BF16") {
    tensor->dtype = detlogp::v1::DTYPE_BFLOAT16;
  } else if (type == "F16") {
    tensor->dtype = detlogp::v1::DTYPE_FLOAT16;
  } else if (type == "I32" || type == "I64") {
    const size_t size = type == "I32" ? 4 : 8;
    tensor->integers.resize(bytes.size() / size);
    for (size_t i = 0; i < tensor->integers.size(); ++i) {
      if (size == 4) {
        int32_t value;
        std::memcpy(&value, bytes.data() + 4 * i, 4);
        tensor->integers[i] = value;
      } else {
        std::memcpy(&tensor->integers[i], bytes.data() + 8 * i, 8);
      }
    }
    return absl::OkStatus();
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unsupported dtype ", type));
  }
  tensor->data = std::move(bytes);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LoadedTensor> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string file = buffer.str();
  if (file.size() < 10 || file.compare(0, 6, "\x93NUMPY") != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a .npy file"));
  }
  const int major = static_cast<unsigned char>(file[6]);
  size_t header_length, header_start;
  if (major == 1) {
    header_length = static_cast<unsigned char>(file[8]) |
                    (static_cast<unsigned char>(file[9]) << 8);
    header_start = 10;
  } else {
    if (file.size() < 12) return absl::InvalidArgumentError("truncated .npy");
    header_length = 0;
    for (int i = 3; i >= 0; --i) {
      header_length =
          (header_length << 8) | static_cast<unsigned char>(file[8 + i]);
    }
    header_start = 12;
  }
  if (header_start + header_length > file.size()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated header"));
  }
  const std::string header = file.substr(header_start, header_length);
  const std::string descr = NpyHeaderValue(header, "descr", '\'', '\'');
  if (header.find("'fortran_order': True") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": Fortran order"));
  }
  LoadedTensor tensor;
  for (absl::string_view dim :
       absl::StrSplit(NpyHeaderValue(header, "shape", '(', ')'), ',',
                      absl::SkipWhitespace())) {
    int64_t value;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(dim), &value)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad shape"));
    }
    tensor.shape.push_back(value);
  }
  std::string type;
  if (descr == "<f4") type = "F32";
  if (descr == "<f2") type = "F16";
  if (descr == "<u2" || descr == "<V2" || descr == "bfloat16") type = "BF16";
  if (descr == "<i4") type = "I32";
  if (descr == "<i8") type = "I64";
  if (type.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unsupported descr '", descr, "'"));
  }
  int64_t elements = 1;
  for (int64_t dim : tensor.shape) elements *= dim;
  const size_t data_start = header_start + header_length;
  const size_t bytes = elements * formats::SafetensorDtypeSize(type);
  if (file.size() - data_start != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": data size does not match shape"));
  }
  if (absl::Status s = SetElements(type, file.substr(data_start), &tensor);
      !s.ok()) {
    return s;
  }
  return tensor;
}

absl::StatusOr<LoadedTensor> ReadSafetensor(const std::string& path,
                                            const std::string& name) {
  auto file = formats::SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  auto bytes = file->ReadTensor(name);
  if (!bytes.ok()) return bytes.status();
  const formats::SafetensorInfo& info = file->tensors().at(name);
  LoadedTensor tensor;
  tensor.shape = info.shape;
  if (absl::Status s = SetElements(
          info.dtype, std::string(bytes->begin(), bytes->end()), &tensor);
      !s.ok()) {
    return s;
  }
  return tensor;
}

absl::StatusOr<LoadedTensor> ReadTensorFile(const std::string& path,
                                            const std::string& name) {
  if (absl::EndsWith(path, ".npy")) return ReadNpy(path);
  if (absl::EndsWith(path, ".safetensors")) return ReadSafetensor(path, name);
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": expected a .npy or .safetensors file"));
}

}  // namespace detlogp::client
