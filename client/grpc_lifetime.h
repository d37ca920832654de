// gRPC initialises itself when its first object is made and shuts down when
// its last one goes, and that shutdown waits out a poller's timeout (up to
// about ten seconds) on the thread that dropped the last reference: a
// program that closes its last client, or a Python process that closes a
// detlogp.Client, would stall that long. The client library keeps gRPC
// initialised for the rest of the process once a client was made, as a
// long-lived server does.
//
// gRPC's threads do not survive fork(): in a child of a process that had
// started them, every call (even on a client made in the child) would wait
// forever, deadline or not. The library refuses there instead.
#ifndef DETLOGP_CLIENT_GRPC_LIFETIME_H_
#define DETLOGP_CLIENT_GRPC_LIFETIME_H_

#include "absl/status/status.h"

namespace detlogp::client {

// Idempotent and thread-safe; never undone.
void KeepGrpcInitialized();

// FAILED_PRECONDITION in a process forked from one where this library had
// initialised gRPC (saying what to do instead); OK otherwise.
absl::Status CheckGrpcUsableInThisProcess();

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_GRPC_LIFETIME_H_
