// Whether a gRPC caller is on this host: shared memory is offered only to
// callers that can share it.
#ifndef DETLOGP_SERVER_TRANSPORT_LOCAL_PEER_H_
#define DETLOGP_SERVER_TRANSPORT_LOCAL_PEER_H_

#include <string>

#include "absl/strings/string_view.h"

namespace detlogp::server {

// True for a peer string (grpc::ServerContext::peer()) of a Unix-domain
// socket ("unix:...", "unix-abstract:...") or a loopback address
// ("ipv4:127.x.x.x:port", "ipv6:[::1]:port", an IPv4-mapped 127.x.x.x;
// brackets may be percent-encoded). Anything else, unparsable included, is
// not local.
bool IsSameHostPeer(absl::string_view peer);

// True when every address the server listens on (--host) is loopback, so
// every caller is on this host ("localhost", 127.x.x.x, ::1).
bool IsLoopbackListenAddress(const std::string& host);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_LOCAL_PEER_H_
