// The servers a push reaches: the targets given, each "dns:" target
// expanded into one per address its name resolves to, so that a push to a
// Kubernetes headless Service stages and commits on every pod behind it
// (gRPC's own "dns:" channel would take one pod per call).
//
//   auto fleet = ExpandPushTargets({"dns:///detlogp.ns.svc:50051"}, {});
//   // {{"10.0.0.7:50051", "dns:///detlogp.ns.svc:50051", "detlogp.ns.svc"},
//   //  {"10.0.0.9:50051", "dns:///detlogp.ns.svc:50051", "detlogp.ns.svc"}}
//   auto channel = MakePushChannel(connection, (*fleet)[0]);
//
// The name is resolved as the scoring client resolves it
// (client/target_resolver.h): every A and AAAA record, without duplicates;
// then ordered by pod ordinal when reverse DNS names them as a
// StatefulSet's pods, so a chain runs pod 0, 1, 2, ...
#ifndef DETLOGP_CLIENT_PUSH_TARGETS_H_
#define DETLOGP_CLIENT_PUSH_TARGETS_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

#include "absl/status/statusor.h"
#include "client/logp_client.h"
#include "client/target_resolver.h"

namespace detlogp::client {

// One server of a push.
struct PushTarget {
  // A gRPC target naming one server: an address a "dns:" name resolved to
  // ("10.0.0.7:50051", "[fd00::3]:50051"), or a target as it was given.
  std::string target;
  // The "dns:" target it was resolved from; empty for a target given as is.
  std::string resolved_from;
  // With TLS, the name the server's certificate must carry: the "dns:"
  // name's host (empty: the target's own host).
  std::string tls_name;
};

// Every target in the order given, a "dns:" target replaced in its place by
// its addresses (`resolver`, empty: ResolveInPodOrder); a
// server met twice is kept once. INVALID_ARGUMENT for a malformed "dns:"
// target; UNAVAILABLE naming a "dns:" target that resolves to no address.
absl::StatusOr<std::vector<PushTarget>> ExpandPushTargets(
    const std::vector<std::string>& targets, const TargetResolver& resolver);

// A channel to `target` of its own (one connection) with `connection`'s
// message limits, channel arguments and TLS; with TLS, a resolved address
// must present a certificate for its name's host.
std::shared_ptr<grpc::Channel> MakePushChannel(
    const LogpClient::Options& connection, const PushTarget& target);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_PUSH_TARGETS_H_
