#ifndef DETLOGP_SERVER_TRANSPORT_UNIX_SOCKET_H_
#define DETLOGP_SERVER_TRANSPORT_UNIX_SOCKET_H_

// A Unix-domain socket beside the TCP port, for clients on the same host.
// One gRPC connection moves ~30-45 % more bytes per second over it than over
// loopback TCP (no TCP stack per segment; docs/performance.md, "H3
// projection streaming"), which is what a co-located consumer of a
// projection stream needs.

#include <string>

#include "absl/status/status.h"

namespace detlogp::server {

// Checks that `path` can be bound by this server, for `flag`'s error
// messages: it fits sockaddr_un, and it is either absent or a stale socket
// nobody accepts on (which is removed). A regular file there, or a socket
// another process serves, is refused rather than replaced.
absl::Status PrepareUnixSocketPath(const std::string& path, const char* flag);

// gRPC's address for the socket: "unix:<path>".
std::string UnixSocketAddress(const std::string& path);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_UNIX_SOCKET_H_
