// Checks the service's promise end to end: probe rows are scored alone, then
// hidden among random rows in concurrent unary and streaming calls of random
// sizes over several connections; every probe must come back with the same
// bits as alone, under the same determinism key. With `entropy` / `top_k`,
// the calls also ask, at random, for the entropy and for top-k lists of
// random sizes in [1, top_k]: a probe's entropy must keep its solo bits and
// its top-k list must be the first k of its solo list, ids and log-probs.
#ifndef DETLOGP_CLIENT_INVARIANCE_CHECK_H_
#define DETLOGP_CLIENT_INVARIANCE_CHECK_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace detlogp::client {

struct InvarianceOptions {
  std::string target = "127.0.0.1:50051";
  int probes = 16;             // distinct probe rows
  int concurrency = 32;        // client threads sending mixed calls
  int calls_per_thread = 4;    // mixed calls each thread makes
  int max_rows_per_call = 64;  // mixed call size is uniform in [1, this]
  int channels = 4;            // distinct connections
  float temperature = 1.0f;
  uint64_t seed = 1;
  // The model (empty: the server's default) and version (0: the latest when
  // the check starts); every call is pinned to that version.
  std::string model;
  int64_t model_version = 0;
  // Half the mixed calls ask for the entropy too (false: none do).
  bool entropy = false;
  // Half the mixed calls ask for a top-k of a size uniform in [1, top_k]
  // (0: none do); at most the server's --max_top_k.
  int64_t top_k = 0;
};

struct InvarianceReport {
  std::string determinism_key;
  bool keys_consistent = true;  // every answer carried the same key
  int64_t calls = 0;            // mixed calls answered
  int64_t stream_calls = 0;     // of which inside streams
  int64_t failed_calls = 0;
  int64_t probe_rows_checked = 0;
  int64_t probe_rows_mismatched = 0;
  // Probe rows whose entropy / top-k list was checked (they count in
  // probe_rows_checked and, when they differ, in probe_rows_mismatched).
  int64_t entropy_rows_checked = 0;
  int64_t top_k_rows_checked = 0;
  std::string first_error;

  bool ok() const {
    return keys_consistent && failed_calls == 0 && probe_rows_mismatched == 0 &&
           probe_rows_checked > 0;
  }
  std::string Summary() const;
};

absl::StatusOr<InvarianceReport> CheckInvariance(
    const InvarianceOptions& options);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_INVARIANCE_CHECK_H_
