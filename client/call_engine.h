// The large-call engine: sends the requests one call was cut into over a set
// of connections, side by side, and returns their answers in request order.
//
// - Flow control: every request holds its rows in the client's RowWindow
//   while it is outstanding, so one client never has more rows at the
//   server than the server can queue (ModelInfo.max_queue_rows).
// - A request the server refuses for a full queue (reason QUEUE_FULL) is
//   sent again, alone, after the server's retry delay with jitter, until the
//   call's deadline; a whole call is never sent again, and no request is
//   outstanding twice. A call its deadline stops fails with
//   DEADLINE_EXCEEDED saying how many rows were answered.
// - One version: the first answer fixes the model version and every request
//   not yet sent is pinned to it; an answer of another version (one
//   published meanwhile) is asked again, pinned.
// - gRPC's callback API carries the requests: the calling thread schedules
//   them, their bytes are written on a bounded pool of threads shared by
//   the client's calls (copying a call's rows into gRPC's buffers on one
//   thread caps a call near 1.3 GB/s), and no thread is started per call.
//
// Errors are decided from the status details (proto/status_details.h),
// never from message text.
#ifndef DETLOGP_CLIENT_CALL_ENGINE_H_
#define DETLOGP_CLIENT_CALL_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
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

// One request of a call: `header` with `rows` as its hidden bytes, written
// once into gRPC's buffer when it is sent; `rows` empty: `header` is the
// whole request (rows in its data or named by reference).
struct CallPart {
  detlogp::v1::LogProbRequest header;
  absl::string_view rows;
  // The call's row this request's first row is: a refusal naming
  // target_ids[i] of the request names target_ids[first_row + i].
  int64_t first_row = 0;
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
};

// What the engine did beside the answers.
struct CallStats {
  int64_t requests_sent = 0;
  // Requests the server refused for a full queue and that were sent again.
  int64_t queue_full_retries = 0;
  // Requests asked again pinned to the call's version.
  int64_t version_retries = 0;
};

// Sends `parts` over `connections` (at least one) and returns their answers
// in the order of `parts`, each checked against its request. The first
// failure that is not a full queue fails the call and cancels the requests
// still outstanding.
absl::StatusOr<std::vector<ScoreResult>> SendCallParts(
    std::vector<CallPart> parts,
    const std::vector<std::shared_ptr<grpc::Channel>>& connections,
    RowWindow& window, const CallEngineOptions& options, absl::Time deadline,
    CallStats* stats = nullptr);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_CALL_ENGINE_H_
