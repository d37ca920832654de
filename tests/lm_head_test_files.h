// Files the live-weights tests serve and upload: a fresh directory under the
// test's temporary root, and lm_heads written as .safetensors
// (lm_head.weight BF16 [V_pad, H], lm_head.bias F32 [V_pad] when present).
#ifndef DETLOGP_TESTS_LM_HEAD_TEST_FILES_H_
#define DETLOGP_TESTS_LM_HEAD_TEST_FILES_H_

#include <string>

#include "absl/status/status.h"
#include "client/model_repository_client.h"

namespace detlogp::testing {

// A new directory <$TEST_TMPDIR or /tmp>/<name>_<pid>_<n>.
std::string MakeTempDir(const std::string& name);

// `upload` as a .safetensors file the server's --model flag reads.
absl::Status WriteLmHeadFile(const std::string& path,
                             const client::LmHeadUpload& upload);

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_LM_HEAD_TEST_FILES_H_
