// The large-call engine: sends the requests one call was cut into over the
// replicas of a model and their connections, side by side, and returns their
// answers in request order.
//
// - Replicas: each request goes to the live replica with the fewest rows
//   outstanding relative to its window. A request whose replica fails with
//   UNAVAILABLE (the connection dropped, the server is gone) or answers that
//   it is shutting down is sent again to another replica within the call's
//   deadline (scoring is idempotent); that replica takes no new request
//   until a probe after a backoff answers. A request is never outstanding at
//   two replicas at once, and its answer is taken once.
// - Flow control: every request holds its rows in its replica's RowWindow
//   while it is outstanding, so one client never has more rows at a server
//   than the server can queue (ModelInfo.max_queue_rows).
// - A request the server refuses for a full queue (reason QUEUE_FULL) is
//   sent again, alone, after the server's retry delay with jitter, until the
//   call's deadline; a whole call is never sent again, and no request is
//   outstanding twice. A call its deadline stops fails with
//   DEADLINE_EXCEEDED saying how many rows were answered.
// - Draining: a replica that leaves the client's set mid-call (its address
//   left DNS) takes no new request of the call; those it holds finish.
// - One version: the first answer fixes the model version and every request
//   not yet sent is pinned to it; an answer of another version (one
//   published meanwhile) is asked again, pinned. A replica that lacks the
//   pinned version (VERSION_UNAVAILABLE, MODEL_NOT_FOUND) takes no more of
//   the call's requests; the call fails with that error only when no live
//   replica is left to ask.
// - gRPC's callback API carries the requests: the calling thread schedules
//   them, their bytes are written on a bounded pool of threads shared by
//   the client's calls (copying a call's rows into gRPC's buffers on one
//   thread caps a call near 1.3 GB/s), and no thread is started per call.
//
// Errors are decided from the status details (proto/status_details.h),
// never from message text.
#ifndef DETLOGP_CLIENT_CALL_ENGINE_H_
#define DETLOGP_CLIENT_CALL_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/score_result.h"
#include "client/task_pool.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::client {

// The rows a client has outstanding at one server, bounded by what the
// server can queue. Shared by every call of the client.
class RowWindow {
 public:
  // `rows`: as SetCapacity.
  explicit RowWindow(int64_t rows = 0) { SetCapacity(rows); }
  // 0: no bound (the server's queue is not known yet).
  void SetCapacity(int64_t rows);
  int64_t capacity() const;
  // Takes `rows` when they fit; a request alone always fits (the server
  // refuses what its queue can never hold).
  bool TryAcquire(int64_t rows);
  void Release(int64_t rows);
  int64_t outstanding() const;

 private:
  mutable absl::Mutex mu_;
  int64_t capacity_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
};

// Whether one replica answers, as the client's calls have seen it: a replica
// that failed takes no new request until its backoff passed; then one request
// (the probe) may go, and no other until it is answered. The backoff doubles
// with each failed probe, up to a bound, and resets when the replica answers.
class ReplicaHealth {
 public:
  struct Options {
    // Backoff after the first failure.
    absl::Duration first_backoff = absl::Milliseconds(100);
    // The longest backoff between probes.
    absl::Duration max_backoff = absl::Seconds(5);
  };
  ReplicaHealth();
  explicit ReplicaHealth(const Options& options);

  // Whether a request may go to the replica at `now` (without taking the
  // probe).
  bool Usable(absl::Time now) const;
  // Takes the right to send one request at `now`: true when the replica is
  // up, or when it is down, due and no probe is out (this request is then the
  // probe, and `*probe` says so).
  bool TryUse(absl::Time now, bool* probe);
  // The replica answered (any status a live server sends): up again.
  void Answered();
  // The replica failed a request at `now`: down for the next backoff.
  void Failed(absl::Time now);
  // A probe given up without an answer (its call ended): another may go.
  void AbandonProbe();
  bool up() const;
  // When a down replica may be probed next (InfinitePast when up).
  absl::Time next_probe() const;

 private:
  const Options options_;
  mutable absl::Mutex mu_;
  bool up_ ABSL_GUARDED_BY(mu_) = true;
  bool probing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  absl::Time next_probe_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// One replica as a call sees it: the client's window and health of it
// (shared by the client's calls, outliving the call) and the connections
// the call may send on (at least one).
struct CallReplica {
  RowWindow* window = nullptr;
  ReplicaHealth* health = nullptr;
  std::vector<std::shared_ptr<grpc::Channel>> connections;
  // Names the replica in errors (its target).
  std::string name;
  // Set while the call runs when the replica leaves the client's set (its
  // address left DNS): it takes none of the call's requests from then on,
  // and those it holds finish there (null: never leaves).
  const std::atomic<bool>* retired = nullptr;
};

// One request of a call: `header` with `rows` as its hidden bytes, written
// once into gRPC's buffer when it is sent; `rows` empty: `header` is the
// whole request (rows in its data or named by reference).
struct CallPart {
  detlogp::v1::LogProbRequest header;
  absl::string_view rows;
  // The call's row this request's first row is: a refusal naming
  // target_ids[i] of the request names target_ids[first_row + i].
  int64_t first_row = 0;
  // For a request naming rows in a shared-memory region the client writes:
  // the thread that sends it copies `region_source` to `region_rows` first,
  // so a large call's copy overlaps the server's work on its earlier
  // requests, and the copies of its requests run side by side.
  char* region_rows = nullptr;
  absl::string_view region_source;
};

struct CallEngineOptions {
  // Requests outstanding on each connection at once.
  int requests_in_flight_per_connection = 2;
  // Where requests' bytes are written and their calls started, side by side
  // (null: on the calling thread, one after another).
  TaskPool* senders = nullptr;
  // Sets a request's deadline and credentials.
  std::function<void(grpc::ClientContext*, absl::Time)> prepare_context;
  // Refusals for a full queue are sent again after the server's delay
  // stretched by a random factor in [1, 1 + retry_jitter].
  double retry_jitter = 0.5;
  // The delay when the server names none.
  absl::Duration default_retry_delay = absl::Milliseconds(20);
  // A replica's window when it names none, to weigh its load against the
  // others' (a server's queue holds at least this many rows unless its
  // flags lower it).
  int64_t unknown_queue_rows = 65536;
};

// What the engine did beside the answers.
struct CallStats {
  int64_t requests_sent = 0;
  // Requests the server refused for a full queue and that were sent again.
  int64_t queue_full_retries = 0;
  // Requests asked again pinned to the call's version.
  int64_t version_retries = 0;
  // Requests sent again to another replica after theirs failed.
  int64_t replica_retries = 0;
  // Requests sent again to another replica after theirs lacked the version.
  int64_t version_moves = 0;
  // Requests answered by each replica, in the order given.
  std::vector<int64_t> answered_by;
};

// Sends `parts` over `replicas` (at least one) and returns their answers in
// the order of `parts`, each checked against its request. The first failure
// that is not a full queue, a failed replica or a missing version fails the
// call and cancels the requests still outstanding. A call whose requests
// have no replica left to try fails with UNAVAILABLE (or the version's
// error) saying how many rows were answered.
absl::StatusOr<std::vector<ScoreResult>> SendCallParts(
    std::vector<CallPart> parts, const std::vector<CallReplica>& replicas,
    const CallEngineOptions& options, absl::Time deadline,
    CallStats* stats = nullptr);

// The same to one server over `connections` (at least one), every failure
// of it final.
absl::StatusOr<std::vector<ScoreResult>> SendCallParts(
    std::vector<CallPart> parts,
    const std::vector<std::shared_ptr<grpc::Channel>>& connections,
    RowWindow& window, const CallEngineOptions& options, absl::Time deadline,
    CallStats* stats = nullptr);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_CALL_ENGINE_H_
