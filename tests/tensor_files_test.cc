#include "client/tensor_files.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "formats/safetensors.h"

namespace detlogp::client {
namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

// Writes a version-1 .npy file with the given descr, shape text and bytes.
std::string WriteNpy(const std::string& name, const std::string& descr,
                     const std::string& shape, const std::string& data) {
  std::string header = "{'descr': '" + descr +
                       "', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  const std::string path = TempPath(name);
  std::ofstream out(path, std::ios::binary);
  out << "\x93NUMPY" << '\x01' << '\x00';
  out.put(static_cast<char>(header.size() & 0xff));
  out.put(static_cast<char>(header.size() >> 8));
  out << header << data;
  return path;
}

TEST(TensorFilesTest, ReadsNpyFloatAndIntegerArrays) {
  const float values[6] = {1, 2, 3, 4, 5, 6};
  const std::string floats =
      WriteNpy("f.npy", "<f4", "(2, 3)",
               std::string(reinterpret_cast<const char*>(values), 24));
  auto tensor = ReadNpy(floats);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(tensor->dtype, v1::DTYPE_FLOAT32);
  EXPECT_EQ(tensor->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(tensor->data.size(), 24u);

  const int64_t ids[3] = {7, 0, 31999};
  const std::string ints =
      WriteNpy("i.npy", "<i8", "(3,)",
               std::string(reinterpret_cast<const char*>(ids), 24));
  auto targets = ReadNpy(ints);
  ASSERT_TRUE(targets.ok());
  EXPECT_EQ(targets->integers, (std::vector<int64_t>{7, 0, 31999}));
}

TEST(TensorFilesTest, RejectsBadNpyFiles) {
  EXPECT_FALSE(ReadNpy(WriteNpy("short.npy", "<f4", "(2, 3)", "abc")).ok());
  EXPECT_FALSE(
      ReadNpy(WriteNpy("type.npy", "<c8", "(1,)", std::string(8, 'x'))).ok());
  EXPECT_FALSE(ReadNpy(TempPath("missing.npy")).ok());
  const std::string text = TempPath("text.npy");
  std::ofstream(text) << "not numpy";
  EXPECT_FALSE(ReadNpy(text).ok());
}

TEST(TensorFilesTest, ReadsSafetensorsByName) {
  const std::string path = TempPath("rows.safetensors");
  std::vector<uint8_t> bf16(2 * 4 * 2, 0x3f);
  ASSERT_TRUE(
      formats::WriteSafetensors(path, {{"hidden", "BF16", {2, 4}, bf16}}).ok());
  auto tensor = ReadTensorFile(path, "hidden");
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(tensor->dtype, v1::DTYPE_BFLOAT16);
  EXPECT_EQ(tensor->shape, (std::vector<int64_t>{2, 4}));
  EXPECT_FALSE(ReadTensorFile(path, "nope").ok());
  EXPECT_FALSE(ReadTensorFile(TempPath("x.bin"), "hidden").ok());
}

}  // namespace
}  // namespace detlogp::client
