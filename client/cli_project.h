// detlogp_cli project: streams the H3 projection of seeded random rows and
// prints the determinism key and a SHA-256 of Y's bits (equal digests
// across servers, CPU or GPU, show equal bits), then timings.
#ifndef DETLOGP_CLIENT_CLI_PROJECT_H_
#define DETLOGP_CLIENT_CLI_PROJECT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "client/logp_client.h"

namespace detlogp::client {

struct ProjectCommandOptions {
  int64_t rows = 4096;
  uint64_t seed = 1;
  // LogpClient::ProjectOptions' rows_per_chunk and streams (0: defaults).
  int64_t rows_per_chunk = 0;
  int streams = 0;
  // Runs of the same projection in this process, each reported.
  int repeats = 1;
  // SHA-256 Y's bits on a thread of its own; false measures the stream
  // alone (y_sha256 prints as -).
  bool hash_y = true;
  // Bytes of Y at most waiting to be hashed before the stream waits.
  int64_t hash_backlog_bytes = int64_t{1} << 30;
};

// Prints, per run: "determinism_key K", "y_sha256 D" (these two first and
// unchanged: suites compare them between a GPU and a CPU server), the whole
// call's time, the stream's, SHA-256's, and the process's CPU time and minor
// page faults per GB of Y with the glibc.malloc.hugetlb it ran with (-:
// unset). Every timing line holds the word "seconds".
absl::Status RunProject(LogpClient& client,
                        const ProjectCommandOptions& options);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_CLI_PROJECT_H_
