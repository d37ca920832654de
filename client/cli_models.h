// detlogp_cli's model-version commands (ModelRepositoryService): models,
// load, upload and unload. The admin token travels only on these calls.
#ifndef DETLOGP_CLIENT_CLI_MODELS_H_
#define DETLOGP_CLIENT_CLI_MODELS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/logp_client.h"
#include "client/model_repository_client.h"

namespace detlogp::client {

struct ModelsCommandOptions {
  // Required by load, upload and unload.
  std::string model;
  // unload: the version to unload (> 0); load, upload: the number to
  // publish the new version as (0: the model's next).
  int64_t model_version = 0;
  // load: a .safetensors file relative to the server's --model_root.
  std::string path;
  // upload: a local .safetensors file.
  std::string weights_file;
  std::string lm_head_tensor;  // empty: lm_head.weight, else the tied embedding
  std::string bias_tensor;
  int64_t vocab_size = 0;  // 0: every weight row
  // load: refuse unless the file's weights hash to this digest.
  std::string expected_sha256;
  // upload: the servers to push to; empty: the connection's target.
  std::vector<std::string> servers;
  // upload: send a delta against this version (0: the whole head), whose
  // weights the pusher holds in `base_weights_file` (a replica cannot send
  // its weights back, so the pusher keeps its base).
  int64_t base_version = 0;
  std::string base_weights_file;
  // upload: "chain", "direct", or empty (chain for more than two servers).
  std::string fanout;
  // upload to several servers: two-phase publish (PushOptions::two_phase).
  bool two_phase = true;
};

// Prints every model, its latest version and each version's status.
absl::Status RunModels(ModelRepositoryClient& client);

// Prints the loaded version's status.
absl::Status RunLoad(ModelRepositoryClient& client,
                     const ModelsCommandOptions& options);

// Pushes the same weights to every server, as a delta against
// --base_version when given (the whole head to a server without the base);
// one line per server. Every server publishes the same number
// (--model_version, else one above the highest any server has). Fails
// unless every server took them and all report the same digest and key.
absl::Status RunUpload(const LogpClient::Options& connection,
                       const ModelRepositoryClient::Options& admin,
                       const ModelsCommandOptions& options);

absl::Status RunUnload(ModelRepositoryClient& client,
                       const ModelsCommandOptions& options);

// INVALID_ARGUMENT naming --model when it is empty.
absl::Status RequireModel(const ModelsCommandOptions& options);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_CLI_MODELS_H_
