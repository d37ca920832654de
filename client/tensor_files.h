// Reads rows for the CLI from .npy or .safetensors files.
#ifndef DETLOGP_CLIENT_TENSOR_FILES_H_
#define DETLOGP_CLIENT_TENSOR_FILES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::client {

struct LoadedTensor {
  detlogp::v1::DType dtype = detlogp::v1::DTYPE_UNSPECIFIED;  // float types
  std::vector<int64_t> shape;
  std::string data;               // raw little-endian elements (float types)
  std::vector<int64_t> integers;  // filled instead for integer tensors
};

// .npy: descr '<f4', '<f2', '<u2' (taken as bf16 bits), '<i4', '<i8'; C order.
absl::StatusOr<LoadedTensor> ReadNpy(const std::string& path);

// One tensor of a .safetensors file (F32, BF16, F16, I32, I64).
absl::StatusOr<LoadedTensor> ReadSafetensor(const std::string& path,
                                            const std::string& name);

// Picks the reader by extension.
absl::StatusOr<LoadedTensor> ReadTensorFile(const std::string& path,
                                            const std::string& name);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_TENSOR_FILES_H_
