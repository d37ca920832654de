// The one safe way for a callback reactor to change state and maybe finish.
//
// Finish may make gRPC call OnDone (which deletes the reactor) at once, on
// another thread. So state changes and the decision to finish happen under
// the reactor's lock, and Finish is called after the lock is released, as
// the caller's last act.
#ifndef DETLOGP_SERVER_TRANSPORT_REACTOR_UPDATE_H_
#define DETLOGP_SERVER_TRANSPORT_REACTOR_UPDATE_H_

#include <grpcpp/support/status.h>

#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace detlogp::server {

// `Base` is a grpc::ServerBidiReactor<...> or grpc::ServerWriteReactor<...>.
// Subclasses keep their state under mu_ and say in StepLocked what happens
// next (start a read or write) and whether to finish.
template <typename Base>
class LockedReactor : public Base {
 protected:
  // Runs `mutate()` under mu_, then StepLocked(); finishes, unlocked, if it
  // returned a status.
  template <typename Mutate>
  void Update(Mutate&& mutate) {
    std::optional<grpc::Status> status;
    {
      absl::MutexLock lock(&mu_);
      mutate();
      status = StepLocked();
    }
    if (status.has_value()) this->Finish(*std::move(status));
  }

  // Takes the next step; returns the status to finish with, or nullopt.
  virtual std::optional<grpc::Status> StepLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;

  absl::Mutex mu_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_REACTOR_UPDATE_H_
