// The one safe way for a callback reactor to change state and maybe finish.
//
// Finish may make gRPC call OnDone (which deletes the reactor) at once, on
// another thread. So state changes and the decision to finish happen under
// the reactor's lock, and Finish is called after the lock is released, as
// the caller's last act.
#ifndef DETLOGP_SERVER_REACTOR_UPDATE_H_
#define DETLOGP_SERVER_REACTOR_UPDATE_H_

#include <grpcpp/support/status.h>

#include <optional>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace detlogp::server {

// Runs `mutate()` then `step()` under `mu`; `step` returns the status to
// finish with, or nullopt. Then, unlocked, calls `finish(status)` if any.
template <typename Mutate, typename Step, typename Finish>
void UpdateThenMaybeFinish(absl::Mutex& mu, Mutate&& mutate, Step&& step,
                           Finish&& finish) {
  std::optional<grpc::Status> status;
  {
    absl::MutexLock lock(&mu);
    mutate();
    status = step();
  }
  if (status.has_value()) finish(*std::move(status));
}

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_REACTOR_UPDATE_H_
