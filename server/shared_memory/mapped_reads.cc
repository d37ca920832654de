#include "server/shared_memory/mapped_reads.h"

#include <setjmp.h>
#include <signal.h>

#include <cstdint>
#include <cstring>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "proto/status_details.h"

namespace detlogp::server {
namespace {

// One guarded read in progress on a thread: where to jump back to, and the
// source bytes whose faults it takes.
struct GuardedRead {
  sigjmp_buf jump;
  uintptr_t begin = 0;
  uintptr_t end = 0;
  GuardedRead* outer = nullptr;  // the read this one runs inside, if any
};

// The innermost guarded read of this thread; null outside one. A pointer
// with constant initialization: the handler reads it without running any
// initialization code.
thread_local GuardedRead* t_guarded_read = nullptr;

// The disposition SIGBUS had before ours, written once before ours is
// installed and only read afterwards.
struct sigaction g_previous_sigbus;
bool g_sigbus_handler_installed = false;

// Gives a SIGBUS that no guarded read takes to whoever would have had it
// without this library.
void ForwardSigbus(int signo, siginfo_t* info, void* context) {
  // sa_handler and sa_sigaction share storage: SIG_DFL and SIG_IGN are
  // recognised whatever the flags say.
  const auto previous = g_previous_sigbus.sa_handler;
  if (previous != SIG_DFL && previous != SIG_IGN) {
    if ((g_previous_sigbus.sa_flags & SA_SIGINFO) != 0) {
      g_previous_sigbus.sa_sigaction(signo, info, context);
    } else {
      previous(signo);
    }
    return;
  }
  // kill, sigqueue, tkill (a fault has a positive code).
  const bool sent_by_a_process = info == nullptr || info->si_code <= 0;
  if (previous == SIG_IGN && sent_by_a_process) return;
  // The default action (a fault cannot be ignored). Once it is restored, a
  // faulting instruction runs again on return and the fault kills the
  // process where it happened (the core shows the real culprit); a signal
  // sent by a process is raised again, delivered as this handler returns.
  struct sigaction default_action;
  std::memset(&default_action, 0, sizeof(default_action));
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  sigaction(SIGBUS, &default_action, nullptr);
  if (sent_by_a_process) raise(SIGBUS);
}

void OnSigbus(int signo, siginfo_t* info, void* context) {
  // Only a fault (si_code > 0) has an address; a SIGBUS sent by kill()
  // is never a guarded read's.
  if (info != nullptr && info->si_code > 0) {
    const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
    for (GuardedRead* read = t_guarded_read; read != nullptr;
         read = read->outer) {
      if (address >= read->begin && address < read->end) {
        // Restores the signal mask saved by sigsetjmp: SIGBUS, blocked
        // while this handler runs, is unblocked again.
        siglongjmp(read->jump, 1);
      }
    }
  }
  ForwardSigbus(signo, info, context);
}

// The handler is process-wide by nature (a signal's disposition is), and
// that is acceptable here: it changes nothing for a SIGBUS outside a guarded
// read, which goes on to the previous handler or the default action exactly
// as before. It is installed on the first guarded read rather than at start
// so that a process that never maps a region keeps its own disposition.
void InstallSigbusHandler() {
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = OnSigbus;
  sigemptyset(&action.sa_mask);
  // SA_ONSTACK: runs on an alternate signal stack where a thread set one.
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  // The previous disposition is read first: a fault on another thread the
  // moment ours is in place must find it.
  g_sigbus_handler_installed =
      sigaction(SIGBUS, nullptr, &g_previous_sigbus) == 0 &&
      sigaction(SIGBUS, &action, nullptr) == 0;
}

bool SigbusHandlerInstalled() {
  static absl::once_flag once;
  absl::call_once(once, InstallSigbusHandler);
  return g_sigbus_handler_installed;
}

}  // namespace

absl::Status ReadFromMapping(const void* src, size_t bytes,
                             absl::FunctionRef<void()> read) {
  if (bytes == 0) {
    read();
    return absl::OkStatus();
  }
  if (!SigbusHandlerInstalled()) {
    return absl::InternalError(
        "cannot install the SIGBUS handler that guards reads of shared "
        "memory");
  }
  GuardedRead guard;
  guard.begin = reinterpret_cast<uintptr_t>(src);
  guard.end = guard.begin + bytes;
  guard.outer = t_guarded_read;
  // savemask = 1: the jump back out of the handler must unblock SIGBUS.
  if (sigsetjmp(guard.jump, /*savemask=*/1) != 0) {
    t_guarded_read = guard.outer;
    return absl::FailedPreconditionError(
        "a page of the mapping vanished under the read: its owner truncated "
        "the object");
  }
  t_guarded_read = &guard;
  read();
  t_guarded_read = guard.outer;
  return absl::OkStatus();
}

absl::Status CopyFromMapping(void* dst, const void* src, size_t bytes) {
  return ReadFromMapping(src, bytes, [&] { std::memcpy(dst, src, bytes); });
}

absl::Status RegionShrankError(absl::string_view field,
                               absl::string_view region) {
  return v1::FieldError(
      absl::StatusCode::kFailedPrecondition, field,
      absl::StrCat("region \"", region,
                   "\" shrank under the request: its owner truncated the "
                   "shared-memory object below the registered bytes; "
                   "register it again"),
      v1::kReasonRegionGone);
}

}  // namespace detlogp::server
