#include "client/grpc_lifetime.h"

#include <grpc/grpc.h>
#include <unistd.h>

#include <atomic>

#include "absl/strings/str_cat.h"

namespace detlogp::client {
namespace {

// The process whose gRPC this library initialised (0: none yet). A fork
// copies it, so a child sees its parent's id.
std::atomic<pid_t> initialized_in{0};

}  // namespace

void KeepGrpcInitialized() {
  // One reference for the process, taken once; its grpc_shutdown never runs.
  static const bool initialized = [] {
    grpc_init();
    initialized_in.store(getpid());
    return true;
  }();
  (void)initialized;
}

absl::Status CheckGrpcUsableInThisProcess() {
  const pid_t initializer = initialized_in.load();
  if (initializer == 0 || initializer == getpid()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this process was forked from process ", initializer,
      ", which had started the detlogp client library's gRPC threads; they "
      "do not survive fork(), so no call could complete here: make clients "
      "in processes started with 'spawn' or 'forkserver', or fork before "
      "the first client is made"));
}

}  // namespace detlogp::client
