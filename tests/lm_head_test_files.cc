#include "tests/lm_head_test_files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "formats/safetensors.h"

namespace detlogp::testing {

std::string MakeTempDir(const std::string& name) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name,
                                       "_", getpid(), "_", counter++);
  mkdir(dir.c_str(), 0755);
  return dir;
}

absl::Status WriteLmHeadFile(const std::string& path,
                             const client::LmHeadUpload& upload) {
  std::vector<formats::SafetensorToWrite> tensors(1);
  tensors[0].name = "lm_head.weight";
  tensors[0].dtype = "BF16";
  tensors[0].shape = {upload.padded_vocab_size, upload.hidden_size};
  const auto* w = reinterpret_cast<const uint8_t*>(upload.weight.data());
  tensors[0].data.assign(w, w + upload.weight.size() * 2);
  if (!upload.bias.empty()) {
    formats::SafetensorToWrite bias;
    bias.name = "lm_head.bias";
    bias.dtype = "F32";
    bias.shape = {upload.padded_vocab_size};
    const auto* b = reinterpret_cast<const uint8_t*>(upload.bias.data());
    bias.data.assign(b, b + upload.bias.size() * 4);
    tensors.push_back(std::move(bias));
  }
  return formats::WriteSafetensors(path, tensors);
}

}  // namespace detlogp::testing
