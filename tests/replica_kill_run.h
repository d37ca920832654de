// Calls from several threads through one LogpClient while one of its
// replicas is killed with SIGKILL, for the tests that show no call is lost
// when a replica dies.
#ifndef DETLOGP_TESTS_REPLICA_KILL_RUN_H_
#define DETLOGP_TESTS_REPLICA_KILL_RUN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "client/logp_client.h"
#include "detlogp/v1/detlogp.pb.h"
#include "tests/server_process.h"

namespace detlogp::testing {

struct KillRun {
  int calls_before_kill = 8;  // answers before the replica is killed
  int calls_after_kill = 16;  // calls begun after it, at least
  std::string path;           // every answer's path, when not empty
};

struct KillRunCounts {
  int calls = 0;
  int calls_after_kill = 0;
  int failed = 0;      // calls that returned an error (each also a failure)
  int wrong_bits = 0;  // answers other than `wanted`'s bits
  int other_path = 0;  // answers whose path is not KillRun::path
  int64_t replica_retries = 0;
};

// Thread t scores requests[t] without pause, comparing each answer with
// wanted[t]; once `run.calls_before_kill` answers are in, `victim` is
// killed with SIGKILL (its exit expected), and the threads go on until
// `run.calls_after_kill` calls began after the kill. Prints the counts.
KillRunCounts ScoreWhileKilling(client::LogpClient& client,
                                const std::vector<v1::LogProbRequest>& requests,
                                const std::vector<client::ScoreResult>& wanted,
                                ServerProcess& victim, const KillRun& run = {});

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_REPLICA_KILL_RUN_H_
