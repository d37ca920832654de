// Checks the service's promise end to end: probe rows are scored alone, then
// hidden among random rows in concurrent unary and streaming calls of random
// sizes over several connections; every probe must come back with the same
// bits as alone, under the same determinism key.
#ifndef DETLOGP_CLIENT_INVARIANCE_CHECK_H_
#define DETLOGP_CLIENT_INVARIANCE_CHECK_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace detlogp::client {

struct InvarianceOptions {
  std::string target = "127.0.0.1:50051";
  int probes = 16;              // distinct probe rows
  int concurrency = 32;         // client threads sending mixed calls
  int calls_per_thread = 4;     // mixed calls each thread makes
  int max_rows_per_call = 64;   // mixed call size is uniform in [1, this]
  int channels = 4;             // distinct connections
  float temperature = 1.0f;
  uint64_t seed = 1;
  // The model (empty: the server's default) and version (0: the latest when
  // the check starts); every call is pinned to that version.
  std::string model;
  int64_t model_version = 0;
};

struct InvarianceReport {
  std::string determinism_key;
  bool keys_consistent = true;    // every answer carried the same key
  int64_t calls = 0;              // mixed calls answered
  int64_t stream_calls = 0;       // of which inside streams
  int64_t failed_calls = 0;
  int64_t probe_rows_checked = 0;
  int64_t probe_rows_mismatched = 0;
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
