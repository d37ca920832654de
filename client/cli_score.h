// detlogp_cli score: log-probs of hidden rows (from files, or seeded random
// rows shaped like the model) printed one line per row, exactly (%.9g
// round-trips a float).
#ifndef DETLOGP_CLIENT_CLI_SCORE_H_
#define DETLOGP_CLIENT_CLI_SCORE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "client/logp_client.h"

namespace detlogp::client {

struct ScoreCommandOptions {
  // Empty: the server's default model; 0: its latest version. The request
  // is pinned to the version resolved first, so a version published
  // meanwhile cannot change the shapes under it.
  std::string model;
  int64_t model_version = 0;
  // [N, H] hidden rows (.npy or .safetensors) and N target ids; with no
  // hidden_path, random_rows seeded rows and targets.
  std::string hidden_path;
  std::string hidden_tensor = "hidden";
  std::string target_ids_path;
  std::string target_ids_tensor = "target_ids";
  int64_t random_rows = 4;
  uint64_t seed = 1;
  float temperature = 1.0f;
  bool return_lse = false;
  bool return_entropy = false;
  int64_t top_k = 0;
  // Print where the call's time went, on stderr: "timing build_us B call_us
  // C server_us S validate_us V queue_us Q compute_us P transfer_us T
  // requests R connections N path grpc|system_shm|cuda_shm" (build: making
  // the request, or uploading the rows to the GPU with cuda_shared_memory;
  // transfer: the call's time not spent on the server, both directions).
  bool timing = false;
  // The client was created with a system shared-memory region: say so on
  // stderr, with the server's reason, when the rows went as bytes instead.
  bool shared_memory = false;
  // Upload the rows to cuda_device once and score them from there
  // (LogpClient::Score(DeviceRows)); the client was created with
  // cuda_shared_memory, so they go through its CUDA region when the server
  // allows it (else to the host and in the messages, said on stderr).
  bool cuda_shared_memory = false;
  int cuda_device = 0;
  // The same call this many times on one client (connections and regions
  // kept between calls): a timing line each, the rows printed once, and
  // DATA_LOSS when a call answers other bits than the first.
  int repeats = 1;
};

// Prints "model M version V", "determinism_key K", then per row
// "row r target t logprob x [lse y] [entropy e] [top_ids i,j,...
// top_logprobs a,b,...]".
absl::Status RunScore(LogpClient& client, const ScoreCommandOptions& options);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_CLI_SCORE_H_
